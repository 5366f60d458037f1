// y[M, N] = x[M, K] @ w[K, N] in float32 with w in a quantized format (formats.py): Q8_0 (w = d q) or
// Q4_1 (w = d q + m), 32-column panels, one scale (and minimum) per 32 k's and column.
//
// Each weight is dequantized to the float32 value formats.dequantize gives (d q is exact; Q4_1's one
// rounding of + m is the same with or without an FMA), and each output element is one FMA chain over
// k = 0..K-1 in order, as in cpu_matmul.cc: the same bits as the float32 kernel on the dequantized
// weights, whatever M, path or thread count. Three paths, by row count, as the float32 kernel's:
// - One row (a decode step): kStreams panels side by side per thread (OneRow), each weight
//   dequantized in the registers (widen, convert, multiply by its block's scale [+ m]) and used by
//   one FMA; the scales load once per 32 k's.
// - Few rows (2-3 for Q4_1, 2-7 for Q8_0): each weight row dequantized once in the registers for a
//   group of rows (Rows).
// - Many rows (Q4_1 from 4, Q8_0 from 8, see Matmul): each block of a panel
//   dequantized into L1 scratch once for all the row groups, then the float32 kernel's tiles over it
//   (cpu_matmul.h's ManyPanelsWith).
// Quantized / float32 time, the model's 30-layer stack with the unembedding side by side
// (tools/time_matmuls.py --format; 2-core Zen 4, AVX-512, at load 4-8 from other work: 4 runs; 4 and
// 16 rows through the register groups, which Matmul has since left for the L1 blocks there):
//   rows      1          4          16         64         512
//   Q8_0   0.31-0.50  0.48-0.80  0.97-1.12  1.02-1.17  0.94-0.99    (weight bytes 0.28)
//   Q4_1   0.33-0.48  0.53-0.74  0.93-1.03  0.82-1.02  0.97-1.14    (weight bytes 0.19)
// At one row the arithmetic binds as much as the bytes (Q4_1, 2/3 of Q8_0's bytes, is no faster):
// per 16 weights a widen, a convert, a multiply (Q4_1: an FMA) and the FMA, against float32's load
// and FMA; the bits allow no less. An AVX2 build on Sapphire Rapids (2026-12-05): Q4_1 0.44 / 0.83-0.95
// / 0.88-0.91 at 1 / 8 / 16 rows, Q8_0 0.52 / 0.99 / 1.00 (see Matmul). The figures by each choice
// below were taken side by side too.
#include <array>

#include "cpu_matmul.h"

#include <immintrin.h>

namespace {

constexpr int64_t kHalf = kPanel / 2;   // Q4_1: bytes per panel row

typedef int32_t IntVec __attribute__((vector_size(kLanes * sizeof(int32_t))));

// kLanes bytes at p widened to int32 lanes, signed or not: one vpmovsxbd / vpmovzxbd. (GCC 12 made
// __builtin_convertvector of a byte vector 16 scalar moves and shifts: the one-row product took
// 2.4x float32's time.)
template <bool Signed>
inline IntVec Widen(const void* p) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(static_cast<const __m128i*>(p));
  const __m512i i = Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
#else
  const __m128i b = _mm_loadl_epi64(static_cast<const __m128i*>(p));
  const __m256i i = Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
#endif
  IntVec v;
  std::memcpy(&v, &i, sizeof v);
  return v;
}

// A format: its panels (At), a panel's scales for one k block (ScalesAt, loaded once per 32 k's) and
// the weights of row k, columns kLanes v.. of the panel, as float32 (Weight).
struct Q8_0 {
  static constexpr int kScaleVecs = 1;  // vectors of scales per weight vector: d
  static constexpr int64_t kManyFrom = 8;  // see Matmul
  struct Panel {
    const int8_t* q;  // [K, 32]
    const float* d;   // [K / 32, 32]
  };
  struct Scales {
    Vec d[kPanelVecs];
  };
  const int8_t* q;  // [P, K, 32]
  const float* d;   // [P, K / 32, 32]
  int64_t K;
  Panel At(int64_t p) const { return {q + p * K * kPanel, d + p * (K / kBlock) * kPanel}; }
  static Scales ScalesAt(const Panel& w, int64_t b) {
    Scales s;
    for (int v = 0; v < kPanelVecs; ++v) s.d[v] = Load(w.d + b * kPanel + kLanes * v);
    return s;
  }
  static Vec Weight(const Panel& w, int64_t k, int v, const Scales& s) {
    const IntVec i = Widen<true>(w.q + k * kPanel + kLanes * v);
    return __builtin_convertvector(i, Vec) * s.d[v];  // exact: 11 significant bits times 7
  }
};

struct Q4_1 {
  static constexpr int kScaleVecs = 2;  // d and m
  static constexpr int64_t kManyFrom = 4;  // see Matmul
  struct Panel {
    const uint8_t* q;  // [K, 16]: byte j holds column j (low nibble) and j + 16 (high nibble)
    const float* d;    // [K / 32, 32]
    const float* m;    // [K / 32, 32]
  };
  struct Scales {
    Vec d[kPanelVecs], m[kPanelVecs];
  };
  const uint8_t* q;  // [P, K, 16]
  const float* d;    // [P, K / 32, 32]
  const float* m;    // [P, K / 32, 32]
  int64_t K;
  Panel At(int64_t p) const {
    const int64_t s = p * (K / kBlock) * kPanel;
    return {q + p * K * kHalf, d + s, m + s};
  }
  static Scales ScalesAt(const Panel& w, int64_t b) {
    Scales s;
    for (int v = 0; v < kPanelVecs; ++v) s.d[v] = Load(w.d + b * kPanel + kLanes * v);
    for (int v = 0; v < kPanelVecs; ++v) s.m[v] = Load(w.m + b * kPanel + kLanes * v);
    return s;
  }
  static Vec Weight(const Panel& w, int64_t k, int v, const Scales& s) {
    const int64_t col = kLanes * v;
    IntVec i = Widen<false>(w.q + k * kHalf + col % kHalf);  // widened first: x86 has no byte shifts
    i = col < kHalf ? (i & 0xF) : (i >> 4);
    return __builtin_convertvector(i, Vec) * s.d[v] + s.m[v];  // one rounding, fused or not
  }
};

// ---- One row ----

// One row over S panels at once (`first`, first + apart, ...), as the float32 OneRowPanels: each
// thread reads S streams side by side. A code becomes a float by a convert (vcvtdq2ps): adding 2^23
// to its bits and subtracting 2^23 as a float (exact too) took 1.02-1.17x the CPU time, one row.
template <typename F, int S>
void OneRow(const float* x, const F& w, float* y, int64_t K, int64_t first, int64_t apart) {
  Vec acc[S][kPanelVecs] = {};
  typename F::Panel panel[S];
  for (int s = 0; s < S; ++s) panel[s] = w.At(first + s * apart);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    typename F::Scales scales[S];
    for (int s = 0; s < S; ++s) scales[s] = F::ScalesAt(panel[s], b);
    for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k) {
      const float xs = x[k];
      for (int v = 0; v < kPanelVecs; ++v)
        for (int s = 0; s < S; ++s) acc[s][v] += xs * F::Weight(panel[s], k, v, scales[s]);
    }
  }
  for (int s = 0; s < S; ++s)
    for (int v = 0; v < kPanelVecs; ++v) Store(y + (first + s * apart) * kPanel + kLanes * v, acc[s][v]);
}
// Panels side by side. AVX-512, the stack at one row (time, CPU time): 4 took 0.83-0.93x the time of
// 8 (the float32 kernel's count; here 8 panels are 16 or 24 streams of codes and scales), 2
// 0.86-0.92x, 16 1.07-1.3x; 3 0.95-1.01x the CPU time of 4, 6 1.1-1.15x; prefetching the codes 64
// rows ahead 1.03-1.13x. AVX2 (not measured) as float32.
constexpr int kStreams = kVecRegs == 32 ? 4 : 2;

// ---- Few rows ----

// Rows 0..R-1 of a pass (xt [K, LD]) over column tile c of a panel, all of K: each weight vector
// dequantized once for the R rows.
template <typename F, int R, int LD>
void Rows(const float* xt, const typename F::Panel& w, float* y, int64_t K, int64_t N, int c) {
  Vec acc[R][kTileVecs] = {};
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const typename F::Scales scales = F::ScalesAt(w, b);
    for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k) {
      Vec wk[kTileVecs];
      for (int v = 0; v < kTileVecs; ++v) wk[v] = F::Weight(w, k, c * kTileVecs + v, scales);
      for (int r = 0; r < R; ++r) {
        const float xs = xt[k * LD + r];
        for (int v = 0; v < kTileVecs; ++v) acc[r][v] += xs * wk[v];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kTileVecs; ++v) Store(y + r * N + c * kTileCols + kLanes * v, acc[r][v]);
}

// Rows per group: the accumulators, the weight row, its scales and x's broadcast in the registers
// (AVX-512: 12 for Q8_0, 11 for Q4_1; AVX2, half a panel at a time: 4 and 3). More rows take two
// groups, each dequantizing the weights again (Matmul says from how many rows the L1 blocks win).
template <typename F>
constexpr int kRowGroup = (kVecRegs - 3 - (1 + F::kScaleVecs) * kTileVecs) / kTileVecs;

// R rows of a pass (xt [K, LD]) in groups of about equal size, each over the whole panel.
template <typename F, int R, int LD>
void Groups(const float* xt, const typename F::Panel& w, float* y, int64_t K, int64_t N, int c) {
  constexpr int groups = (R + kRowGroup<F> - 1) / kRowGroup<F>, G = (R + groups - 1) / groups;
  Rows<F, G, LD>(xt, w, y, K, N, c);
  if constexpr (R > G) Groups<F, R - G, LD>(xt + G, w, y + G * N, K, N, c);
}

template <typename F, int R>
void Pass(const float* xt, const typename F::Panel& w, float* y, int64_t K, int64_t N) {
  for (int c = 0; c < kColTiles; ++c) Groups<F, R, R>(xt, w, y, K, N, c);
}

template <typename F>
using PassFn = void (*)(const float*, const typename F::Panel&, float*, int64_t, int64_t);
template <typename F, int... Rs>
constexpr PassFn<F> kPasses[] = {nullptr, &Pass<F, Rs>...};
template <typename F>
constexpr auto& kPassFor = kPasses<F, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16>;

template <typename F>
void FewRows(ffi::ThreadPool& pool, const float* x, const F& w, float* y, int64_t M, int64_t K, int64_t N) {
  FewRowsWith(pool, x, M, K, N, [w, y, M, K, N](const float* xt, int64_t p, int64_t end) {
    if (M == 1) {  // the run's panels in kStreams parts, read side by side
      const int64_t part_len = (end - p) / kStreams;
      for (int64_t i = p; i < p + part_len; ++i) OneRow<F, kStreams>(xt, w, y, K, i, part_len);
      p += kStreams * part_len;
      const int64_t half = (end - p) / 2;
      for (int64_t i = p; i < p + half; ++i) OneRow<F, 2>(xt, w, y, K, i, half);
      p += 2 * half;  // an odd one left: below
    }
    for (; p < end; ++p)
      for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass)
        kPassFor<F>[std::min(kRowsPerPass, M - m0)](xt + m0 * K, w.At(p), y + m0 * N + p * kPanel, K, N);
  });
}

// ---- Many rows ----

// Each kBlockK-row block of a panel dequantized into the thread's scratch (24 KB, in L1), once for
// all the row groups' tiles.
template <typename F>
void ManyRows(ffi::ThreadPool& pool, const float* x, const F& w, float* y, int64_t M, int64_t K, int64_t N) {
  ManyRowsWith(pool, x, M, K, N, [=](const float* xp, int64_t p0, int64_t p1) {
    float* const wide = ThreadScratch<5>(kBlockK * kPanel);
    ManyPanelsWith(xp, y, M, K, N, p0, p1, [w, wide](int64_t p, int64_t k0, int64_t kc) {
      const typename F::Panel panel = w.At(p);
      for (int64_t b = k0 / kBlock; b < (k0 + kc) / kBlock; ++b) {  // kc: a multiple of kBlock
        const typename F::Scales scales = F::ScalesAt(panel, b);
        for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k)
          for (int v = 0; v < kPanelVecs; ++v) Store(wide + (k - k0) * kPanel + kLanes * v, F::Weight(panel, k, v, scales));
      }
      return static_cast<const float*>(wide);
    });
  });
}

// From F::kManyFrom rows (Q4_1 4, Q8_0 8) each block is dequantized into L1 once for the float32 tiles
// (ManyRows), not once per row group in the registers (FewRows): a group holds a weight row's codes
// and scales beside 3-12 rows, so 16 rows dequantized each weight 2-6 times. The L1 blocks against
// the row groups (tools/time_matmuls.py --format F --against, Sapphire Rapids, side by side, bits
// equal): AVX-512 build, Q4_1 0.72-0.78x the time at 4 rows, 0.81-0.88x at 8, 0.80x at 12, 1.00-1.03x
// at 16; Q8_0 1.04x at 4, 0.91x at 8, 0.72-0.74x at 12, 0.94x at 16. AVX2 build: Q4_1 0.90x at 4,
// 0.84x at 8, 0.75x at 12, 0.70x at 16; Q8_0 0.98-1.03x at 4 and 8, 0.89-0.94x at 12, 0.84x at 16.
template <typename F>
void Matmul(ffi::ThreadPool& pool, const float* x, const F& w, float* y, int64_t M, int64_t K, int64_t N) {
  (M < F::kManyFrom ? FewRows<F> : ManyRows<F>)(pool, x, w, y, M, K, N);
}

ffi::Error MatmulQ8_0(ffi::ThreadPool pool, Matrix x, CodesQ8 q, Scales d, LayerIndex layer, OutMatrix y) {
  const auto [l, P, K] = QuantShapes(x, layer, kPanel, q.dimensions(), d, nullptr, y);
  if (l < 0)
    return ffi::Error::InvalidArgument(
        "matmul_q8_0: needs x [M, K], q [L, N / 32, K, 32], d [L, N / 32, K / 32, 32], layer in 0..L-1");
  Matmul(pool, x.typed_data(), Q8_0{q.typed_data() + l * P * K * kPanel, d.typed_data() + l * P * K, K},
         y->typed_data(), x.dimensions()[0], K, P * kPanel);
  return ffi::Error::Success();
}

ffi::Error MatmulQ4_1(ffi::ThreadPool pool, Matrix x, CodesQ4 q, Scales d, Scales m, LayerIndex layer, OutMatrix y) {
  const auto [l, P, K] = QuantShapes(x, layer, kHalf, q.dimensions(), d, &m, y);
  if (l < 0)
    return ffi::Error::InvalidArgument(
        "matmul_q4_1: needs x [M, K], q [L, N / 32, K, 16], d and m [L, N / 32, K / 32, 32], layer in 0..L-1");
  Matmul(pool, x.typed_data(),
         Q4_1{q.typed_data() + l * P * K * kHalf, d.typed_data() + l * P * K, m.typed_data() + l * P * K, K},
         y->typed_data(), x.dimensions()[0], K, P * kPanel);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsmolMatmulQ8_0, MatmulQ8_0, BindQ8_0());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsmolMatmulQ4_1, MatmulQ4_1, BindQ4_1());
