// Causal attention for the jitted forward (cpu_kernels.py), float32: each query row over positions
// 0..its own of its row's cache. The cache is float32 or bfloat16 (JaxsmolAttentionBf16: `--kv-dtype
// bfloat16`), read in place either way; a bfloat16 key or value is widened exactly as it loads (the
// top 16 bits of a float32, LoadWeight/Widen), and everything else (q, scores, softmax, sums, out) is
// float32, so a bfloat16 cache gives the bits of a float32 cache holding the same values while the
// keys and values read are half the bytes. (Templates over KV, the cache's element: float or uint16_t.)
//
// Why: XLA reads the cache in 256-slot blocks through dynamic slices, and for a batch (or several kv
// heads) a block is not contiguous, so every block of every layer was copied before its two matmuls
// (0.4 ms per slice at 16 rows); every row paid for the longest row's blocks; and the masked
// running softmax over 64-row query tiles ran at ~40 GFLOP/s in prefill. Here each (query row, kv
// head) reads its keys and values in place, only up to its own position, on its own: its bits do
// not depend on the chunk or batch it arrives in.
//
// q [B, T, K, G, H] (scaled, RoPE applied), k_all and v_all [L, R, K, S, H] (float32 or bfloat16),
// pos [B] (row b's first query position; the chunk's keys are already in the cache), rows [B] (the cache
// row b's queries read: a decode batch's rows or the KV arena's, jaxsmol/runtime/kv_arena.py)
// -> out [B, T, K, G, H].
// Softmax in two passes: scores, then max, exp and sum, then P V, each in position order.
#include "cpu_kernels.h"

namespace {

typedef int32_t IVec __attribute__((vector_size(kLanes * sizeof(int32_t))));

// A cache element as float32: itself, or a bfloat16's bits shifted up (exact; the vector form is
// LoadWeight in cpu_kernels.h).
inline float Widen(float x) { return x; }
inline float Widen(uint16_t x) {
  const uint32_t bits = uint32_t{x} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Cache elements per 64-byte line: the prefetches' step.
template <typename KV>
constexpr int64_t kLineOf = 64 / sizeof(KV);

// Sum of the lanes in a fixed tree order (halves, quarters, ...).
inline float LaneSum(Vec v) {
#if defined(__AVX512F__)  // kLanes == 16
  Vec h = v + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  h += __builtin_shufflevector(h, h, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
  h += __builtin_shufflevector(h, h, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
#else  // kLanes == 8
  Vec h = v + __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  h += __builtin_shufflevector(h, h, 2, 3, 0, 1, 2, 3, 0, 1);
#endif
  return h[0] + h[1];
}

// exp(x) for x <= 0 (scores minus their maximum): Cephes' single-precision polynomial, ~1 ulp.
inline Vec ExpNonPositive(Vec x) {
  const Vec lo = Vec{} - 87.0f;  // exp(-87) ~ 1.6e-38, the smallest normal power of two the scaling below forms
  x = x < lo ? lo : x;
  const IVec n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, IVec);  // round(x / ln 2) for x <= 0
  const Vec nf = __builtin_convertvector(n, Vec);
  const Vec r = x - nf * 0.693359375f + nf * 2.12194440e-4f;  // x - n ln 2, ln 2 in two parts
  Vec p = Vec{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const IVec bits = (n + 127) << 23;  // 2^n
  Vec scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// The largest power of two <= both hv (itself a power of two) and fit.
constexpr int ChunkOf(int hv, int fit) { return hv <= fit ? hv : ChunkOf(hv / 2, fit); }

// One (row, kv head), keys p0..p1-1, for GQ of its query heads at once: queries q [GQ, H] -> the
// running-softmax state of that key range, m [GQ] (max score), l [GQ] (sum of exp(score - m)) and
// acc [GQ, H] (sum of exp(score - m) v), unnormalized. HV = H / kLanes vectors per head vector;
// scores is scratch of at least GQ (p1 - p0 + kLanes). Each key and value is read once for the GQ
// heads, prefetched 8 keys ahead (one pass per head read them GQ times, from L2 after the first: at
// position 2000 the step's attention streamed ~12 GB/s). Every sum keeps its order (q.k over h, then
// the lanes; P V over positions), so the grouping changes no bits. Side by side with one pass per head
// (tools/time_decode_attention.py --against): 0.74-0.82x the time at position 2000 (1 row; 8 rows
// 0.77-0.81x), without the prefetch 0.85-0.91x.
constexpr int kHeadsAtOnce = 3;  // GQ at most (SmolLM2: 3 query heads per kv head)

template <typename KV, int HV, int GQ>
void AttendKeysOf(const float* q, const KV* keys, const KV* values, int64_t p0, int64_t p1, bool stream_values,
                  float* scores, float* m_out, float* l_out, float* acc_out) {
  constexpr int64_t H = HV * kLanes, kAheadKeys = 8, kLine = kLineOf<KV>;
  const int64_t n = p1 - p0, padded = (n + kLanes - 1) / kLanes * kLanes;  // a head's scores are `padded` apart
  keys += p0 * H;
  values += p0 * H;
  float m[GQ];
  for (int g = 0; g < GQ; ++g) m[g] = -INFINITY;
  for (int64_t p = 0; p < n; ++p) {
    for (int64_t c = 0; c < H; c += kLine) __builtin_prefetch(keys + (p + kAheadKeys) * H + c);
    for (int64_t c = 0; stream_values && c < H; c += kLine) __builtin_prefetch(values + (p + kAheadKeys) * H + c, 0, 2);
    Vec d[GQ];
    const Vec k0 = LoadWeight(keys + p * H);
    for (int g = 0; g < GQ; ++g) d[g] = Load(q + g * H) * k0;
    for (int j = 1; j < HV; ++j) {
      const Vec kj = LoadWeight(keys + p * H + kLanes * j);
      for (int g = 0; g < GQ; ++g) d[g] += Load(q + g * H + kLanes * j) * kj;
    }
    for (int g = 0; g < GQ; ++g) {
      const float sc = LaneSum(d[g]);
      scores[g * padded + p] = sc;
      m[g] = sc > m[g] ? sc : m[g];
    }
  }
  for (int g = 0; g < GQ; ++g) {
    float* sg = scores + g * padded;
    Vec l = Vec{};
    for (int64_t p = 0; p < padded; p += kLanes) {
      Vec e = ExpNonPositive(Load(sg + p) - m[g]);
      for (int64_t i = n - p; i < kLanes; ++i) e[i] = 0.0f;  // lanes past the last position
      Store(sg + p, e);
      l += e;
    }
    m_out[g] = m[g];
    l_out[g] = LaneSum(l);
  }
  // P V in chunks of J head vectors, so GQ x J accumulators fit the registers beside a value vector
  // and a broadcast (AVX2, 3 heads, H = 64: 2 passes over the values)
  constexpr int J = ChunkOf(HV, (kVecRegs - 2) / GQ);
  for (int j0 = 0; j0 < HV; j0 += J) {
    Vec acc[GQ][J] = {};
    for (int64_t p = 0; p < n; ++p) {
      for (int64_t c = 0; c < H; c += kLine) __builtin_prefetch(values + (p + kAheadKeys) * H + c);
      for (int j = 0; j < J; ++j) {
        const Vec vj = LoadWeight(values + p * H + kLanes * (j0 + j));
        for (int g = 0; g < GQ; ++g) acc[g][j] += scores[g * padded + p] * vj;
      }
    }
    for (int g = 0; g < GQ; ++g)
      for (int j = 0; j < J; ++j) Store(acc_out + g * H + kLanes * (j0 + j), acc[g][j]);
  }
}

// All G query heads of one (row, kv head), kHeadsAtOnce at a time (scores: kHeadsAtOnce x its scratch).
template <typename KV, int HV>
void AttendKeys(const float* q, const KV* keys, const KV* values, int64_t G, int64_t p0, int64_t p1,
                bool stream_values, float* scores, float* m_out, float* l_out, float* acc_out) {
  static_assert(kHeadsAtOnce == 3, "the dispatch below names GQ = 1, 2, 3");
  constexpr int64_t H = HV * kLanes;
  for (int64_t g = 0; g < G;) {
    const int64_t gq = std::min<int64_t>(kHeadsAtOnce, G - g);
    (gq == 3 ? &AttendKeysOf<KV, HV, 3> : gq == 2 ? &AttendKeysOf<KV, HV, 2> : &AttendKeysOf<KV, HV, 1>)(
        q + g * H, keys, values, p0, p1, stream_values, scores, m_out + g, l_out + g, acc_out + g * H);
    g += gq;
  }
}

// A decode step's attention: each query row (b, t) of [B, T] as the decode step at its position
// ps[b] + t would compute it (T is 1 for a decode step; a speculative step verifies T drafted rows
// this way, so each gets a decode step's bits: cached and plain decoding agree). Each (row, kv head)
// is split into kDecodeParts key ranges (from kSplitFrom keys on), computed as separate tasks and
// merged in order, so that 3 kv heads keep 2 threads busy; the split depends only on the row's own
// position, so a row's bits do not depend on the batch or on the rows beside it.
constexpr int64_t kDecodeParts = 2, kSplitFrom = 256;
// With this many query rows and keys in a range, the range's values stream into L2 beside its keys
// for P V: the two streams overlap (tools/time_decode_attention.py --against, 4-8 rows at 300-1000
// keys: 0.85-0.91x the time); one row took 1.05-1.13x with it, short ranges ~1.05x.
constexpr int64_t kStreamValuesRows = 4, kStreamValuesKeys = 128;

// Row-head rk's output from its parts' states (m, l, acc as AttendDecode lays them out), in order.
template <int64_t H>
void MergeParts(int64_t rk, int64_t parts, int64_t G, const float* m, const float* l, const float* acc, float* os) {
  constexpr int64_t P = kDecodeParts;
  for (int64_t g = 0; g < G; ++g) {
    float mx = -INFINITY;
    for (int64_t part = 0; part < parts; ++part) mx = std::max(mx, m[(rk * P + part) * G + g]);
    float scale[kDecodeParts], sum = 0.0f;
    for (int64_t part = 0; part < parts; ++part) {
      scale[part] = std::exp(m[(rk * P + part) * G + g] - mx);
      sum += l[(rk * P + part) * G + g] * scale[part];
    }
    for (int64_t h = 0; h < H; ++h) {
      float v = 0.0f;
      for (int64_t part = 0; part < parts; ++part) v += acc[((rk * P + part) * G + g) * H + h] * scale[part];
      os[(rk * G + g) * H + h] = v / sum;
    }
  }
}

template <typename KV, int HV>
void AttendDecode(ffi::ThreadPool& pool, const float* qs, const KV* ks, const KV* vs, const int32_t* ps,
                  const int32_t* rs, float* os, int64_t layer, int64_t NR, int64_t B, int64_t T, int64_t K, int64_t G,
                  int64_t S) {
  constexpr int64_t H = HV * kLanes;
  const int64_t P = kDecodeParts, R = B * T;  // query rows r = b T + t
  const auto keys_of = [ps, S, T](int64_t r) {
    return std::min<int64_t>(std::max<int32_t>(ps[r / T], 0) + r % T, S - 1) + 1;
  };
  const auto parts_of = [P](int64_t n) { return n >= kSplitFrom ? P : 1; };
  std::vector<float> m(R * K * P * G), l(R * K * P * G), acc(R * K * P * G * H);
  ParallelFor(pool, R * K * P, [&, qs, ks, vs, rs](int64_t task) {
    const int64_t rk = task / P, part = task % P, r = rk / K;
    const int64_t n = keys_of(r), parts = parts_of(n);
    if (part >= parts) return;
    const int64_t p0 = n * part / parts, p1 = n * (part + 1) / parts;
    const int64_t slots = ((layer * NR + rs[r / T]) * K + rk % K) * S * H;  // [layer, rows[b], kh] in [L, R, K, S, H]
    std::vector<float> scores(kHeadsAtOnce * (p1 - p0 + kLanes));
    const bool stream_values = R >= kStreamValuesRows && p1 - p0 >= kStreamValuesKeys;
    AttendKeys<KV, HV>(qs + rk * G * H, ks + slots, vs + slots, G, p0, p1, stream_values, scores.data(), &m[task * G],
                       &l[task * G], &acc[task * G * H]);
    if (parts == 1) MergeParts<H>(rk, 1, G, m.data(), l.data(), acc.data(), os);  // here, on this task's thread
  });
  for (int64_t rk = 0; rk < R * K; ++rk) {  // the split rows' parts, once both are done
    const int64_t parts = parts_of(keys_of(rk / K));
    if (parts > 1) MergeParts<H>(rk, parts, G, m.data(), l.data(), acc.data(), os);
  }
}

// A prompt chunk's tile: RV vectors of query rows (one row per lane; up to kRowVecs), scored against
// KeysFor<RV> keys at a time over the head dims (q transposed, so a key element is one broadcast for
// RV x keys FMAs); then P V with the head dims in the vectors: kValueVecs vectors of a value row
// against kRowsAtOnce rows' probabilities (broadcasts). Each score is one FMA chain over h in order,
// each output one chain over positions in order, whatever the tile, so the tile changes no bits.
// AVX-512 (32 registers): 32-row tiles, 12 keys (24 accumulators: 14 loads per 24 FMAs, against 9 per
// 8 with 16 rows and 8 keys); P V 6 rows x 4 vectors (10 loads per 24 FMAs, against 17 per 16 with
// rows in the vectors). Side by side with those (tools/time_decode_attention.py --against, 30
// layers, bits equal): 512-row chunks at 0 / 512 / 1536 0.82 / 0.80 / 0.82x the time, 64 rows at
// 1008 0.81-0.87x, 16 rows 0.90-0.97x. Blocking P V's positions so that values stay in L1 across
// row groups: no change. AVX2: 16 rows, 6 keys, and P V by rows (TileValuesByRows).
constexpr int kRowVecs = 2;
template <int RV>
constexpr int KeysFor = kVecRegs == 32 ? (RV == 2 ? 12 : 8) : 6;  // AVX2 always runs RV = 2 (AttendAll)
// A short chunk (AVX-512, up to 16 rows: the warm path's suffix) puts all G heads of a kv head in one
// tile of up to kCombinedVecs row vectors (8 keys: 24 accumulators, 11 loads per 24 FMAs), so the
// keys and values are read once per kv head, not once per head, and the lanes are full; it streams
// them from memory, so its scores prefetch the keys kKeysAhead blocks ahead and the same block's
// values into L2 for P V. 16 rows at 1008 (tools/time_decode_attention.py --against, 30 layers,
// bits equal): 0.87x the time (heads together), 0.83-0.88x of that with the cache flushed from the
// caches between runs (the prefetches); in the model's 16-row chunk (tools/profile_forward.py)
// 10.7 -> 8.3 ms. Tried: the rows split in two tasks per kv head for 2 threads (1.25x the time), 2 + 1
// heads a task (1.15x); the prefetches in every tile (512-row chunks 1.01-1.03x).
constexpr int kCombinedVecs = 3;
static_assert(kVecRegs == 16 || KeysFor<kCombinedVecs> * kCombinedVecs + kCombinedVecs + 1 <= kVecRegs);
constexpr int kTileRows = kRowVecs * kLanes;
constexpr int64_t kKeysAhead = 2;  // blocks of keys

// Scores of one query head's tile rows (qg: [H, RT] transposed, RT = RV kLanes) against keys 0..n-1,
// masked to each row's position (row_pos, -1 for a lane past the tile's rows): sg [padded, RT] and
// the rows' maxima m. Stream: prefetch the keys ahead, and the values P V will read (see kCombinedVecs).
template <typename KV, int HV, int RV, bool Stream>
void TileScores(const float* qg, const KV* keys, const KV* values, int64_t n, const Vec* row_pos, float* sg,
                Vec* m) {
  constexpr int64_t H = HV * kLanes, RT = RV * kLanes, KK = KeysFor<RV>, kLine = kLineOf<KV>;
  const Vec minus_inf = Vec{} - INFINITY;
  for (int i = 0; i < RV; ++i) m[i] = minus_inf;
  for (int64_t p = 0; p < n; p += KK) {
    for (int64_t c = 0; Stream && c < KK * H; c += kLine) {
      __builtin_prefetch(keys + std::min(p + kKeysAhead * KK, n - 1) * H + c);
      __builtin_prefetch(values + std::min(p, n - 1) * H + c, 0, 2);
    }
    const KV* key[KK];
    for (int k = 0; k < KK; ++k) key[k] = keys + std::min(p + k, n - 1) * H;
    Vec acc[KK][RV] = {};
    for (int64_t h = 0; h < H; ++h) {
      Vec qh[RV];
      for (int i = 0; i < RV; ++i) qh[i] = Load(qg + h * RT + i * kLanes);
      for (int k = 0; k < KK; ++k) {
        const float kv = Widen(key[k][h]);
        for (int i = 0; i < RV; ++i) acc[k][i] += qh[i] * kv;
      }
    }
    for (int k = 0; k < KK; ++k)
      for (int i = 0; i < RV; ++i) {
        const Vec s = static_cast<float>(p + k) <= row_pos[i] ? acc[k][i] : minus_inf;
        m[i] = s > m[i] ? s : m[i];
        Store(sg + (p + k) * RT + i * kLanes, s);
      }
  }
}

// P V: out rows r0..r0+R-1 of the tile (row stride q_stride) = sum over positions p < n, in order,
// of e[p, r] v[p], times inv[r]; e is sg [n, RT] (the exps), head dims J vectors at a time.
constexpr int kValueVecs = 4;
template <typename KV, int HV, int R, int RT>
void TileValues(const float* sg, const KV* values, int64_t n, const float* inv, float* out, int64_t q_stride) {
  constexpr int64_t H = HV * kLanes;
  constexpr int J = HV < kValueVecs ? HV : kValueVecs;
  for (int64_t j0 = 0; j0 < HV; j0 += J) {
    Vec acc[R][J] = {};
    for (int64_t p = 0; p < n; ++p) {
      Vec v[J];
      for (int j = 0; j < J; ++j) v[j] = LoadWeight(values + p * H + (j0 + j) * kLanes);
      for (int r = 0; r < R; ++r) {
        const float e = sg[p * RT + r];
        for (int j = 0; j < J; ++j) acc[r][j] += e * v[j];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j) Store(out + r * q_stride + (j0 + j) * kLanes, acc[r][j] * inv[r]);
  }
}

// P V with the rows in the vectors (one row per lane), kByRowsChunk head dims a pass over the keys: for
// AVX2's 16 registers, where the form above (2 rows x 4 vectors) took 1.09-1.15x the time (the kernel
// built for AVX2 and timed on an AVX-512 machine, tools/time_decode_attention.py --against).
constexpr int kByRowsChunk = 4;
template <typename KV, int HV, int RV>
void TileValuesByRows(const float* sg, const KV* values, int64_t n, const float* inv, float* out, int64_t q_stride,
                      int64_t R) {
  constexpr int64_t H = HV * kLanes, RT = RV * kLanes;
  for (int64_t h0 = 0; h0 < H; h0 += kByRowsChunk) {
    Vec acc[kByRowsChunk][RV] = {};
    for (int64_t p = 0; p < n; ++p) {
      Vec e[RV];
      for (int i = 0; i < RV; ++i) e[i] = Load(sg + p * RT + i * kLanes);
      for (int j = 0; j < kByRowsChunk; ++j) {
        const float v = Widen(values[p * H + h0 + j]);
        for (int i = 0; i < RV; ++i) acc[j][i] += e[i] * v;
      }
    }
    for (int j = 0; j < kByRowsChunk; ++j)
      for (int i = 0; i < RV; ++i) {
        const Vec o = acc[j][i] * Load(inv + i * kLanes);
        for (int r = 0; r < kLanes && i * kLanes + r < R; ++r) out[(i * kLanes + r) * q_stride + h0 + j] = o[r];
      }
  }
}

// Rows at once in P V: accumulators R x J, beside J value vectors and a broadcast.
template <int HV>
constexpr int kRowsAtOnce = std::min(8, (kVecRegs - 3 - std::min(HV, kValueVecs)) / std::min(HV, kValueVecs));

template <typename KV, int HV, int RT, int... Rs>
constexpr decltype(&TileValues<KV, HV, 1, RT>) kValueTiles[] = {nullptr, &TileValues<KV, HV, Rs, RT>...};
template <typename KV, int HV, int RT>
constexpr auto& kValueTileFor = kValueTiles<KV, HV, RT, 1, 2, 3, 4, 5, 6, 7, 8>;

// One tile: R query rows (positions first..first+R-1) of G query heads of one kv head, GT heads a
// tile pass (GT R <= RT lanes: lane g R + t is head g's row t), so a short chunk's heads share the
// keys' and values' reads and fill the lanes.
template <typename KV, int HV, int RV, bool Stream = false>
void AttendRows(const float* q, int64_t q_stride, const KV* keys, const KV* values, float* out,
                int64_t G, int64_t GT, int64_t R, int64_t first, int64_t S) {
  constexpr int64_t H = HV * kLanes, RT = RV * kLanes, KK = KeysFor<RV>;
  const int64_t n = std::min(first + R - 1, S - 1) + 1;  // keys the last row sees
  const int64_t padded = (n + KK - 1) / KK * KK, passes = G / GT;
  float* const qt = ThreadScratch<0>(passes * H * RT + padded * RT);  // [passes, H, RT], then the scores
  float* const sg = qt + passes * H * RT;  // [padded, RT]: one pass's scores, then their exps
  std::fill(qt, qt + passes * H * RT, 0.0f);
  for (int64_t r = 0; r < R; ++r)  // q transposed: qt[pass][h] is RV vectors over (head, row) lanes
    for (int64_t g = 0; g < G; ++g)
      for (int64_t h = 0; h < H; ++h) qt[((g / GT) * H + h) * RT + g % GT * R + r] = q[r * q_stride + g * H + h];
  Vec row_pos[RV];  // a lane past the tile's rows can see nothing
  for (int i = 0; i < RT; ++i)
    row_pos[i / kLanes][i % kLanes] = i < GT * R ? static_cast<float>(std::min(first + i % R, S - 1)) : -1.0f;
  const Vec minus_inf = Vec{} - INFINITY;
  for (int64_t pass = 0; pass < passes; ++pass) {
    Vec m[RV];
    TileScores<KV, HV, RV, Stream>(qt + pass * H * RT, keys, values, n, row_pos, sg, m);
    Vec l[RV] = {};
    for (int64_t p = 0; p < n; ++p)
      for (int i = 0; i < RV; ++i) {
        const Vec s = Load(sg + p * RT + i * kLanes);
        const Vec e = s > minus_inf ? ExpNonPositive(s - m[i]) : Vec{};
        l[i] += e;
        Store(sg + p * RT + i * kLanes, e);
      }
    float inv[RT];
    for (int i = 0; i < RV; ++i) Store(inv + i * kLanes, 1.0f / l[i]);
    for (int64_t gt = 0; gt < GT; ++gt) {
      float* const o = out + (pass * GT + gt) * H;
      if constexpr (kVecRegs == 16) {
        TileValuesByRows<KV, HV, RV>(sg, values, n, inv, o, q_stride, R);  // (AVX2: GT is 1)
      } else {
        constexpr int64_t RA = kRowsAtOnce<HV>;
        for (int64_t r0 = 0; r0 < R; r0 += RA)
          kValueTileFor<KV, HV, RT>[std::min(RA, R - r0)](sg + gt * R + r0, values, n, inv + gt * R + r0,
                                                          o + r0 * q_stride, q_stride);
      }
    }
  }
}

using Queries = ffi::Buffer<ffi::F32, 5>;
template <ffi::DataType CacheType>
using CacheOf = ffi::Buffer<CacheType, 5>;
using Cache = CacheOf<ffi::F32>;
using CacheBf16 = CacheOf<ffi::BF16>;  // elements as uint16_t (XLA's FFI maps BF16 to it)
using Positions = ffi::Buffer<ffi::S32, 1>;  // also the cache rows of the queries' rows
using OutQueries = ffi::ResultBuffer<ffi::F32, 5>;

// Attention with head dim H = kLanes HV over [B, T, K, G, H] queries.
// as_steps: every row as a decode step computes it (a speculative step's drafted rows).
template <typename KV, int HV>
void AttendAll(ffi::ThreadPool& pool, const float* qs, const KV* ks, const KV* vs, const int32_t* ps,
               const int32_t* rs, float* os, int64_t layer, int64_t NR, int64_t B, int64_t T, int64_t K, int64_t G,
               int64_t S, bool as_steps) {
  constexpr int64_t H = HV * kLanes;
  if (T == 1 || as_steps) return AttendDecode<KV, HV>(pool, qs, ks, vs, ps, rs, os, layer, NR, B, T, K, G, S);
  // a chunk: one task per (row, kv head, tile of kTileRows query positions), or, when that leaves threads
  // idle (3 kv heads on 2 threads), per query head too: each head's rows are computed the same way
  // either way, only the keys are read once per head instead of per kv head. A short chunk on
  // AVX-512: one task per (row, kv head), its heads in one tile (see kCombinedVecs).
  const int64_t tiles = (T + kTileRows - 1) / kTileRows, row_stride = K * G * H;  // q and out are [B, T, K, G, H]
  const bool together = kVecRegs == 32 && T <= kLanes && G * T <= kCombinedVecs * kLanes;
  const int64_t heads = !together && B * K * tiles < 4 * pool.num_threads() ? G : 1, per_task = G / heads;
  ParallelFor(pool, B * K * heads * tiles, [=](int64_t task) {
    const int64_t b = task / (K * heads * tiles), kh = task / (heads * tiles) % K;
    const int64_t g = task / tiles % heads * per_task, t0 = task % tiles * kTileRows;
    const int64_t slots = ((layer * NR + rs[b]) * K + kh) * S * H;
    const int64_t offset = (b * T + t0) * row_stride + (kh * G + g) * H;
    const int64_t rows = std::min<int64_t>(kTileRows, T - t0), first = std::max<int64_t>(ps[b], 0) + t0;
    if constexpr (kVecRegs == 32) {  // (AVX2 never takes these: not compiled there)
      if (together) {  // as few row vectors as hold them
        const int64_t vecs = (G * rows + kLanes - 1) / kLanes;
        (vecs == 1   ? &AttendRows<KV, HV, 1, true>
         : vecs == 2 ? &AttendRows<KV, HV, 2, true>
                     : &AttendRows<KV, HV, kCombinedVecs, true>)(
            qs + offset, row_stride, ks + slots, vs + slots, os + offset, G, G, rows, first, S);
        return;
      }
    }
    // AVX2: 16-row tiles, as measured
    (rows <= kLanes && kVecRegs == 32 ? &AttendRows<KV, HV, 1> : &AttendRows<KV, HV, kRowVecs>)(
        qs + offset, row_stride, ks + slots, vs + slots, os + offset, per_task, 1, rows, first, S);
  });
}

// AttendAll for a head of hv vectors, nullptr for another size. Only the sizes a head of 16-128 floats
// takes are compiled (1-8 vectors of 16 lanes, 2-16 of 8): each costs seconds of the first start.
constexpr int kMinHV = 16 / kLanes, kMaxHV = 128 / kLanes;
template <typename KV>
using AttendFn = decltype(&AttendAll<KV, kMinHV>);
template <typename KV, int HV = kMinHV>
AttendFn<KV> AttendFor(int64_t hv) {
  if constexpr (HV > kMaxHV)
    return nullptr;
  else
    return hv == HV ? &AttendAll<KV, HV> : AttendFor<KV, 2 * HV>(hv);
}

// The cache's element type names the kernel: F32 (float) or BF16 (uint16_t, widened as it loads).
template <ffi::DataType CacheType>
ffi::Error Attention(ffi::ThreadPool pool, Queries q, CacheOf<CacheType> k_all, CacheOf<CacheType> v_all,
                     Positions pos, Positions rows, LayerIndex layer_index, int32_t as_steps, OutQueries out) {
  using KV = ffi::NativeType<CacheType>;
  const auto qd = q.dimensions(), cd = k_all.dimensions();
  const int64_t B = qd[0], T = qd[1], K = qd[2], G = qd[3], H = qd[4], S = cd[3], layer = LayerOf(layer_index, cd[0]);
  if (cd[2] != K || cd[4] != H || pos.dimensions()[0] != B || rows.dimensions()[0] != B || layer < 0)
    return ffi::Error::InvalidArgument("attention kernel: shapes of q, cache, pos and rows disagree");
  for (int64_t b = 0; b < B; ++b)
    if (rows.typed_data()[b] < 0 || rows.typed_data()[b] >= cd[1])
      return ffi::Error::InvalidArgument("attention kernel: a query row's cache row is outside the cache");
  auto* attend = H == 16 || H == 32 || H == 64 || H == 128 ? AttendFor<KV>(H / kLanes) : nullptr;
  if (!attend) return ffi::Error::InvalidArgument("attention kernel: head_dim must be 16, 32, 64 or 128");
  attend(pool, q.typed_data(), k_all.typed_data(), v_all.typed_data(), pos.typed_data(), rows.typed_data(),
         out->typed_data(), layer, cd[1], B, T, K, G, S, as_steps != 0);
  return ffi::Error::Success();
}

}  // namespace

// Built as two objects, one a cache type (cpu_kernels.py UNITS: JAXSMOL_ATTENTION_CACHE=F32 or BF16), so
// that two cores compile them at once: this file was 14 of a cold start's 18 s of compiling kernels.
#define JAXSMOL_F32 1
#define JAXSMOL_BF16 2
#if !defined(JAXSMOL_ATTENTION_CACHE) || JAXSMOL_ATTENTION_CACHE == JAXSMOL_F32
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsmolAttention, Attention<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Queries>()
                                  .Arg<Cache>()
                                  .Arg<Cache>()
                                  .Arg<Positions>()
                                  .Arg<Positions>()
                                  .Arg<LayerIndex>()
                                  .Attr<int32_t>("as_steps")
                                  .Ret<Queries>());
#endif

#if !defined(JAXSMOL_ATTENTION_CACHE) || JAXSMOL_ATTENTION_CACHE == JAXSMOL_BF16
// The same over a bfloat16 cache (`--kv-dtype bfloat16`): the bits of JaxsmolAttention on a float32
// cache holding the same values.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsmolAttentionBf16, Attention<ffi::BF16>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Queries>()
                                  .Arg<CacheBf16>()
                                  .Arg<CacheBf16>()
                                  .Arg<Positions>()
                                  .Arg<Positions>()
                                  .Arg<LayerIndex>()
                                  .Attr<int32_t>("as_steps")
                                  .Ret<Queries>());
#endif
