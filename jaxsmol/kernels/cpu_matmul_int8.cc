// y[M, N] = x[M, K] @ w[K, N] in the integer-dot class (`--matmul int8`): w in Q8_0 or Q4_1
// (formats.py, its codes in k-quads: formats.to_dot), x rounded to 8 bits per 32 k's as llama.cpp
// rounds it (its Q8_0 / Q8_1 activations), each block's dot product in integers.
//
// For a row of x and a block b of 32 k's: dx = max |x| / 127, qx = round(x / dx) (to nearest even),
// sx = dx * sum(qx). For each column n, with w = d q (Q8_0) or d q + m (Q4_1):
//   acc = fma(d[b, n] * dx, sum_k q[k, n] qx[k], acc)       the integer sum exact, < 2^24
//   acc = fma(m[b, n], sx, acc)                              (Q4_1)
// over b = 0, 1, ... in order, acc from 0. Every path below (one row, many rows, any thread count)
// runs these operations per row and column, so a row's bits depend on nothing but the row: alone
// or beside other rows, in a chunk of any length, decoded or prefilled. They do not equal the
// float32 kernel's on the dequantized weights (x is rounded); docs/performance.md states the error.
//
// The codes: a panel's 32 columns by 4 consecutive k's (a quad), so one 32-bit lane holds one
// column's 4 codes: x86's u8 x s8 multiply-add of byte pairs (vpmaddubsw) then of 16-bit pairs
// (vpmaddwd) sums them into the column's lane. Q4_1's codes (0..15) are the unsigned operand, as
// they are; Q8_0's signed codes take their magnitude, and x their sign (llama.cpp's way): products
// below 2^15 either way, so nothing saturates. Q4_1 sums a block's 8 quads in 16 bits (8 x 2 x 15 x
// 127 < 2^15) before widening once. With VNNI (AVX512_VNNI, AVX-VNNI) one vpdpbusd does a quad's
// products and sums: the same integers (Q8_0 at one row on Sapphire Rapids: 0.35x float32's time
// against 0.41-0.46x without it, 16 rows 0.51-0.57x against 0.80x).
#include "cpu_matmul.h"

#include <immintrin.h>

#include <array>

namespace {

constexpr int64_t kQuads = kBlock / 4;            // quads per block
constexpr int kVecs = kPanel / kLanes;            // vectors per panel: AVX2 4, AVX-512 2
constexpr int64_t kAheadQuads = 32;               // prefetch distance (2-4 KB)

#if defined(__AVX512F__) && !defined(__AVX512BW__)
#define JAXSMOL_NO_INT8 1  // 16 lanes without byte arithmetic (Xeon Phi): the handlers refuse
#endif

#if (defined(__AVX512F__) && defined(__AVX512VNNI__)) || (!defined(__AVX512F__) && defined(__AVXVNNI__))
#define JAXSMOL_VNNI 1  // vpdpbusd: a lane's 4 byte products summed into it in one instruction
#endif

#if !defined(JAXSMOL_NO_INT8)
#if defined(__AVX512F__)
using IVec = __m512i;
inline IVec LoadI(const void* p) { return _mm512_loadu_si512(p); }
inline IVec Splat32(int32_t v) { return _mm512_set1_epi32(v); }
inline IVec Splat16(int16_t v) { return _mm512_set1_epi16(v); }
inline IVec Zero() { return _mm512_setzero_si512(); }
inline IVec MulPairs(IVec u, IVec s) { return _mm512_maddubs_epi16(u, s); }
inline IVec MulAdd16(IVec a, IVec b) { return _mm512_madd_epi16(a, b); }
inline IVec Add16(IVec a, IVec b) { return _mm512_add_epi16(a, b); }
inline IVec Add32(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
inline IVec And(IVec a, IVec b) { return _mm512_and_si512(a, b); }
inline IVec Shift4(IVec a) { return _mm512_srli_epi16(a, 4); }
inline IVec Abs8(IVec a) { return _mm512_abs_epi8(a); }
inline IVec SignBy(IVec x, IVec w) {  // x where w > 0, -x where w < 0 (0 where w == 0 is not needed: |w| = 0)
  return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
}
inline Vec ToFloat(IVec a) { return (Vec)_mm512_cvtepi32_ps(a); }
inline IVec RoundToInt(Vec a) { return _mm512_cvtps_epi32((__m512)a); }
inline void StoreI(int32_t* p, IVec a) { _mm512_storeu_si512(p, a); }
inline Vec Max(Vec a, Vec b) { return (Vec)_mm512_max_ps((__m512)a, (__m512)b); }
inline Vec Fma(Vec a, Vec b, Vec c) { return (Vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
#else
using IVec = __m256i;
inline IVec LoadI(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline IVec Splat32(int32_t v) { return _mm256_set1_epi32(v); }
inline IVec Splat16(int16_t v) { return _mm256_set1_epi16(v); }
inline IVec Zero() { return _mm256_setzero_si256(); }
inline IVec MulPairs(IVec u, IVec s) { return _mm256_maddubs_epi16(u, s); }
inline IVec MulAdd16(IVec a, IVec b) { return _mm256_madd_epi16(a, b); }
inline IVec Add16(IVec a, IVec b) { return _mm256_add_epi16(a, b); }
inline IVec Add32(IVec a, IVec b) { return _mm256_add_epi32(a, b); }
inline IVec And(IVec a, IVec b) { return _mm256_and_si256(a, b); }
inline IVec Shift4(IVec a) { return _mm256_srli_epi16(a, 4); }
inline IVec Abs8(IVec a) { return _mm256_abs_epi8(a); }
inline IVec SignBy(IVec x, IVec w) { return _mm256_sign_epi8(x, w); }
inline Vec ToFloat(IVec a) { return (Vec)_mm256_cvtepi32_ps(a); }
inline IVec RoundToInt(Vec a) { return _mm256_cvtps_epi32((__m256)a); }
inline void StoreI(int32_t* p, IVec a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), a); }
inline Vec Max(Vec a, Vec b) { return (Vec)_mm256_max_ps((__m256)a, (__m256)b); }
inline Vec Fma(Vec a, Vec b, Vec c) { return (Vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#endif

inline Vec Splat(float v) { return Vec{} + v; }

// sum + (u . s over each lane's 4 bytes), u unsigned, s signed: one vpdpbusd with VNNI, else a
// multiply-add of byte pairs then of 16-bit pairs (|pair sum| < 2^15 for the codes here: exact).
inline IVec DotQuads(IVec sum, IVec u, IVec s) {
#if defined(JAXSMOL_VNNI) && defined(__AVX512F__)
  return _mm512_dpbusd_epi32(sum, u, s);
#elif defined(JAXSMOL_VNNI)
  return _mm256_dpbusd_avx_epi32(sum, u, s);
#else
  return Add32(sum, MulAdd16(MulPairs(u, s), Splat16(1)));
#endif
}
inline Vec Abs(Vec a) {
  typedef int32_t Bits __attribute__((vector_size(sizeof(Vec))));
  Bits b;
  std::memcpy(&b, &a, sizeof b);
  b &= 0x7FFFFFFF;
  std::memcpy(&a, &b, sizeof a);
  return a;
}

// x's rows rounded: codes [M, K], and per block dx and sx [M, K / 32].
struct Rounded {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t K;
};

// One row's block of 32 floats -> 32 codes, its dx and sx: amax and the code sum are order-free (a
// max, an integer sum), each code rounded on its own (vcvtps2dq: to nearest even).
inline void RoundBlock(const float* x, int8_t* q, float* d, float* s) {
  constexpr int kParts = kBlock / kLanes;
  Vec v[kParts], amax = {};
  for (int i = 0; i < kParts; ++i) {
    v[i] = Load(x + kLanes * i);
    amax = Max(amax, Abs(v[i]));
  }
  float top = 0.0f;
  for (int l = 0; l < kLanes; ++l) top = std::max(top, amax[l]);
  const float dx = top / 127.0f, inv = dx != 0.0f ? 1.0f / dx : 0.0f;
  alignas(64) int32_t codes[kBlock];
  for (int i = 0; i < kParts; ++i) StoreI(codes + kLanes * i, RoundToInt(v[i] * inv));  // |code| <= 127
  int32_t sum = 0;
  for (int i = 0; i < kBlock; ++i) {
    q[i] = static_cast<int8_t>(codes[i]);
    sum += codes[i];
  }
  *d = dx;
  *s = dx * static_cast<float>(sum);
}

// The two formats: a panel's codes of quad g as kLanes columns (vector v) in the unsigned-operand
// form, their step into a block's integer sums with x's 4 codes (splat), the block's sums as int32,
// and the float update.
struct Q8_0 {
  static constexpr int64_t kQuadBytes = 4 * kPanel;
  struct Panel {
    const int8_t* q;  // [K / 4, 32, 4]
    const float* d;   // [K / 32, 32]
  };
  static const char* Bytes(const Panel& w) { return reinterpret_cast<const char*>(w.q); }
  static std::array<const float*, 2> Scales(const Panel& w) { return {w.d, nullptr}; }
  static IVec Codes(const Panel& w, int64_t g, int v) { return LoadI(w.q + g * 4 * kPanel + 4 * kLanes * v); }
  static IVec Step(IVec sum, IVec w, IVec x4) { return DotQuads(sum, Abs8(w), SignBy(x4, w)); }
  static IVec Total(IVec sum) { return sum; }
  static Vec Update(Vec acc, const Panel& w, int64_t b, int v, IVec sum, float dx, float) {
    return Fma(Load(w.d + b * kPanel + kLanes * v) * dx, ToFloat(sum), acc);
  }
};

struct Q4_1 {
  static constexpr int64_t kQuadBytes = 2 * kPanel;
  struct Panel {
    const uint8_t* q;  // [K / 4, 16, 4]: byte (g, j, i) holds column j (low nibble) and j + 16 (high) at k = 4 g + i
    const float* d;    // [K / 32, 32]
    const float* m;    // [K / 32, 32]
  };
  static const char* Bytes(const Panel& w) { return reinterpret_cast<const char*>(w.q); }
  static std::array<const float*, 2> Scales(const Panel& w) { return {w.d, w.m}; }
  static IVec Codes(const Panel& w, int64_t g, int v) {
    const int64_t col = kLanes * v;
    const IVec bytes = LoadI(w.q + g * 2 * kPanel + 4 * (col % (kPanel / 2)));
    return And(col < kPanel / 2 ? bytes : Shift4(bytes), Splat32(0x0F0F0F0F));
  }
#if defined(JAXSMOL_VNNI)
  static IVec Step(IVec sum, IVec w, IVec x4) { return DotQuads(sum, w, x4); }
  static IVec Total(IVec sum) { return sum; }
#else  // a block's 8 quads summed in 16 bits, widened once
  static IVec Step(IVec sum, IVec w, IVec x4) { return Add16(sum, MulPairs(w, x4)); }
  static IVec Total(IVec sum) { return MulAdd16(sum, Splat16(1)); }
#endif
  static Vec Update(Vec acc, const Panel& w, int64_t b, int v, IVec sum, float dx, float sx) {
    acc = Fma(Load(w.d + b * kPanel + kLanes * v) * dx, ToFloat(sum), acc);
    return Fma(Load(w.m + b * kPanel + kLanes * v), Splat(sx), acc);
  }
};

// Rows r0..r0+R-1 of x (rounded) by vectors v0..v0+V-1 of a panel, all of K, into y (row stride N).
// `ahead`: where this pass fetches lines into L2, `lines` of them a block (see Matmul).
template <typename F, int R, int V>
void DotTile(const Rounded& x, int64_t r0, const typename F::Panel& w, float* y, int64_t N, int v0,
             const char* ahead = nullptr, int lines = 0) {
  const int64_t K = x.K, KB = K / kBlock;
  Vec acc[R][V] = {};
  for (int64_t b = 0; b < KB; ++b) {
    for (int i = 0; i < lines; ++i) __builtin_prefetch(ahead + (b * lines + i) * 64, 0, 2);
    IVec sum[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) sum[r][v] = Zero();
    for (int64_t g = b * kQuads; g < (b + 1) * kQuads; ++g) {
      for (int64_t line = 0; line < F::kQuadBytes; line += 64)
        __builtin_prefetch(F::Bytes(w) + (g + kAheadQuads) * F::kQuadBytes + line);
      IVec codes[V];
      for (int v = 0; v < V; ++v) codes[v] = F::Codes(w, g, v0 + v);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, x.q + (r0 + r) * K + 4 * g, 4);
        const IVec x4 = Splat32(four);
        for (int v = 0; v < V; ++v) sum[r][v] = F::Step(sum[r][v], codes[v], x4);
      }
    }
    for (int r = 0; r < R; ++r) {
      const float dx = x.d[(r0 + r) * KB + b], sx = x.s[(r0 + r) * KB + b];
      for (int v = 0; v < V; ++v) acc[r][v] = F::Update(acc[r][v], w, b, v0 + v, F::Total(sum[r][v]), dx, sx);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) Store(y + r * N + kLanes * (v0 + v), acc[r][v]);
}


// Rows per group and vectors per pass over a panel beside one row: the sums and accumulators (2 a
// row and vector), the codes and x's splat in the registers (AVX2: 3 rows, half a panel a pass;
// AVX-512: 7, the whole panel). Measured on AVX2 (tools/time_matmuls.py --dot int8, 8 and 16 rows):
// the accumulators in memory with 5 rows a group, or a quarter panel a pass with 8, were no faster.
constexpr int kPassVecs = kVecRegs == 32 ? kVecs : 2;
constexpr int kDotGroup = (kVecRegs - 2 - kPassVecs) / (2 * kPassVecs);

template <typename F>
using DotTileFn = void (*)(const Rounded&, int64_t, const typename F::Panel&, float*, int64_t, int, const char*, int);
template <typename F, int... Rs>
constexpr DotTileFn<F> kDotTiles[] = {nullptr, &DotTile<F, Rs, kPassVecs>...};
template <typename F>
constexpr auto& kDotTileFor = kDotTiles<F, 1, 2, 3, 4, 5, 6, 7>;
static_assert(kDotGroup <= 7);

// x [M, K] -> its codes and scales (ThreadScratch site 6, reused by the pool threads during this call).
Rounded Round(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K) {
  // Up to 16 rows in one task, on the calling thread: rounding 8 rows takes a few microseconds, about
  // what handing half of them to a pool thread costs (an 8-row decode step, AVX2 build, alternated
  // step by step: 0.975x the time of rounding them in two tasks).
  const int64_t KB = K / kBlock, rows_per_task = 16;
  float* const scales = ThreadScratch<6>(2 * M * KB + (M * K + 3) / 4);
  const Rounded r{reinterpret_cast<const int8_t*>(scales + 2 * M * KB), scales, scales + M * KB, K};
  int8_t* const q = const_cast<int8_t*>(r.q);
  ParallelFor(pool, (M + rows_per_task - 1) / rows_per_task, [=](int64_t t) {
    for (int64_t m = t * rows_per_task; m < std::min(M, (t + 1) * rows_per_task); ++m)
      for (int64_t b = 0; b < KB; ++b)
        RoundBlock(x + m * K + b * kBlock, q + m * K + b * kBlock, scales + m * KB + b, scales + M * KB + m * KB + b);
  });
  return r;
}

// at(p): panel p of the layer's matrix.
template <typename F, typename At>
void Matmul(ffi::ThreadPool& pool, const float* x, At at, float* y, int64_t M, int64_t K, int64_t N) {
  const Rounded r = Round(pool, x, M, K);
  const int64_t panels = N / kPanel;
  ParallelForShares(pool, panels, 1, [=](int64_t p, int64_t, bool fetch_next) {  // and the next panel's reading begun
    const typename F::Panel panel = at(p);
    float* const yp = y + p * kPanel;
    if (M == 1) {  // the whole panel in one pass: its codes read once, one stream (2 or 4 side by side: no faster)
      DotTile<F, 1, kVecs>(r, 0, panel, yp, N, 0);
      return;
    }
    // Many rows make several passes over the panel; only the first would read it from memory, the
    // others running from cache, so reading and arithmetic would take turns. Each pass also fetches
    // its share of the next panel's codes into L2, a few lines a block (that panel's scales at
    // once), so the reading overlaps every pass (AVX2, Q8_0 at 8 rows: 0.84-0.91x the time of passes that do not).
    const int passes = static_cast<int>((M + kDotGroup - 1) / kDotGroup * (kVecs / kPassVecs));
    const int64_t share = (K / 4 * F::kQuadBytes + passes - 1) / passes;
    const int lines = fetch_next ? static_cast<int>((share / (K / kBlock) + 63) / 64) : 0;
    const typename F::Panel next = at(fetch_next ? p + 1 : p);
    const char* ahead = F::Bytes(next);
    for (const float* scales : F::Scales(next))
      if (lines > 0 && scales != nullptr)
        for (int64_t i = 0; i < K / kBlock * kPanel; i += 16) __builtin_prefetch(scales + i, 0, 2);
    for (int64_t m0 = 0; m0 < M; m0 += kDotGroup)
      for (int v0 = 0; v0 < kVecs; v0 += kPassVecs, ahead += share)
        kDotTileFor<F>[std::min<int64_t>(kDotGroup, M - m0)](r, m0, panel, yp + m0 * N, N, v0, ahead, lines);
  });
}
#endif

ffi::Error MatmulQ8_0(ffi::ThreadPool pool, Matrix x, CodesQ8 q, Scales d, LayerIndex layer, OutMatrix y) {
  const auto [l, P, K] = QuantShapes(x, layer, kPanel, q.dimensions(), d, nullptr, y);
  if (l < 0)
    return ffi::Error::InvalidArgument(
        "matmul_q8_0_int8: needs x [M, K], q [L, N / 32, K, 32], d [L, N / 32, K / 32, 32], layer in 0..L-1");
#if defined(JAXSMOL_NO_INT8)
  return ffi::Error::InvalidArgument("matmul_q8_0_int8: this CPU has AVX-512 without AVX512BW");
#else
  const int8_t* const codes = q.typed_data() + l * P * K * kPanel;
  const float* const scales = d.typed_data() + l * P * K;
  Matmul<Q8_0>(pool, x.typed_data(), [=](int64_t p) {
    return Q8_0::Panel{codes + p * K * kPanel, scales + p * (K / kBlock) * kPanel};
  }, y->typed_data(), x.dimensions()[0], K, P * kPanel);
  return ffi::Error::Success();
#endif
}

ffi::Error MatmulQ4_1(ffi::ThreadPool pool, Matrix x, CodesQ4 q, Scales d, Scales m, LayerIndex layer, OutMatrix y) {
  const auto [l, P, K] = QuantShapes(x, layer, kPanel / 2, q.dimensions(), d, &m, y);
  if (l < 0)
    return ffi::Error::InvalidArgument(
        "matmul_q4_1_int8: needs x [M, K], q [L, N / 32, K, 16], d and m [L, N / 32, K / 32, 32], layer in 0..L-1");
#if defined(JAXSMOL_NO_INT8)
  return ffi::Error::InvalidArgument("matmul_q4_1_int8: this CPU has AVX-512 without AVX512BW");
#else
  const uint8_t* const codes = q.typed_data() + l * P * K * (kPanel / 2);
  const float* const ds = d.typed_data() + l * P * K;
  const float* const ms = m.typed_data() + l * P * K;
  Matmul<Q4_1>(pool, x.typed_data(), [=](int64_t p) {
    const int64_t s = p * (K / kBlock) * kPanel;
    return Q4_1::Panel{codes + p * K * (kPanel / 2), ds + s, ms + s};
  }, y->typed_data(), x.dimensions()[0], K, P * kPanel);
  return ffi::Error::Success();
#endif
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsmolMatmulQ8_0Int8, MatmulQ8_0, BindQ8_0());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsmolMatmulQ4_1Int8, MatmulQ4_1, BindQ4_1());
