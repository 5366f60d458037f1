// y[M, N] = x[M, K] @ w[K, N] in float32 for the jitted forward (cpu_kernels.py): every matmul of the
// model, decode steps and prefill chunks alike. The weight may be stored in bfloat16 (widened exactly
// as it loads: LoadWeight), which halves what a decode step streams.
//
// Summation order: every output element is one fused multiply-add chain over k = 0, 1, ..., K-1,
// whatever M, the path below, the thread count or the tiling. So a row's bits do not depend on how
// many other rows share the call: a decode row is batch-invariant, and a prompt row gets the same
// bits in a chunk of 16 rows as in one of 512 (what lets the prefix cache stay exact with short
// chunks; XLA:CPU's GEMM sums differently below 64 rows).
//
// The weight comes packed (cpu_kernels.pack, once at load): [N / 32, K, 32], each 32-column panel
// contiguous over k. A panel's k-th row is 128 adjacent bytes, so both paths read the weight as one
// sequential stream per thread, and the many-row path needs no packing of its own. Row-major [K, N]
// read 16 columns at a time was 16 row streams 2-6 KB apart, which the hardware prefetchers did not
// keep up with: 1.16x / 1.64x / 1.51x the time at 1 / 8 / 16 rows (tools/time_matmuls.py).
//
// Two paths, by row count:
// - Few rows (decode steps up to 15 rows, 16 with AVX2: M < kManyFrom). XLA:CPU (like OpenBLAS) packs a panel of
//   the weight before every product; at 2-16 rows that costs more than the arithmetic. This path
//   applies each weight row to every row of x while it is in registers (see PanelPass), prefetching
//   the panel kAhead rows ahead where it is read in k blocks (see kWholeAhead, OneRowPanels).
// - Many rows (prefill chunks, wider decode steps). BLIS's blocking: x packed once into groups of 14
//   rows, k-major within each k block; per thread, its panels taken kBlockK rows at a time (24 KB,
//   in L1); a 14 x 32 register tile (28 accumulators; 6 x 16, twice per panel, with AVX2's 16
//   registers) over that block, kept between blocks in a contiguous scratch and stored to y after
//   the last, so each element is still one chain in k order. Measured in the model: as fast as XLA's GEMM at 512 rows. A bfloat16 block is widened
//   once, for all row groups.
// The register tile, the passes' transposition and the many-row path are in cpu_matmul.h, shared
// with the quantized weights' kernel (cpu_matmul_quant.cc).
#include "cpu_matmul.h"

namespace {

// Few rows, in groups: weight rows per k block (in L1). AVX2, float32: 16 (2 KB); 32 took 1.03-1.15x
// the time at 3-8 rows (tools/time_matmuls.py --against), 8 about as 16; bfloat16 weights at 16:
// 1.03-1.04x. 32 where 16 was slower or not measured (AVX-512).
template <typename W>
constexpr int64_t kBlockRows = kColTiles > 1 && sizeof(W) == 4 ? 16 : 32;
// Few rows: up to kFewWhole rows run as one tile over the whole panel; more take turns in groups of
// kFewGroup on each k block (accumulators 2 per row, plus the weight's 2 vectors, in the registers).
constexpr int kFewWhole = kVecRegs == 32 ? 9 : 6, kFewGroup = kVecRegs == 32 ? 8 : 6;

// ---- Few rows ----

// Rows 0..R-1 of a pass (xt [K, LD]) over rows k0..k1 of one column tile, in groups of kFewGroup; the
// first group prefetches when Lead.
// (V vectors a row and groups of GS rows: the whole-panel groups below.)
template <typename W, int R, int LD, bool Lead, int V = kTileVecs, int GS = kFewGroup>
inline void Groups(const float* xt, const W* panel, float* y, int64_t N, int64_t k0, int64_t k1) {
  constexpr int G = R < GS ? R : GS;
  Tile<W, G, LD, Lead ? kAhead : 0, false, V>(xt, panel, y, N, y, N, k0, k1, k0 == 0);
  if constexpr (R > G) Groups<W, R - G, LD, false, V, GS>(xt + G, panel, y + G * N, N, k0, k1);
}

// Whole-panel groups: Groups over the whole panel at once (kPanelVecs vectors a row), kWholeGroup rows
// a group:
// with AVX2 (two column tiles) at 1-3 rows. Each accumulator is a latency-bound FMA chain, and a
// half-panel tile's 2 accumulators a row left 1-3 rows short of independent chains; a whole-panel
// tile gives each row 4. Measured in a 30-layer stack of the model's matmuls, side by side
// (tools/time_matmuls.py --against): 0.81-0.87x the time at 1 row, 0.80-0.84x at 2, 0.85-0.89x at 3.
constexpr int kWholeGroup = (kVecRegs - 1) / kPanelVecs - 1;  // accumulators + the panel row + x's broadcast
constexpr int kWholeUpTo = kColTiles > 1 ? 3 : 0;  // 4 rows: 0.94-1.03x, 5-16: 1.03-1.09x
// A whole-panel tile over all of K reads its panel as one sequential stream, which the hardware
// prefetcher follows alone: with AVX2 (1-2 rows) software prefetches only took load slots, 0.95x
// the time at 2 rows without them (and 0.93x at 1, OneRowPanels). Kept where not measured (AVX-512).
constexpr int64_t kWholeAhead = kColTiles > 1 ? 0 : kAhead;

// One pass of R rows (xt [K, R], transposed) over one panel. Up to kFewWhole rows of a whole-panel
// tile run over all of K (with AVX2: up to kWholeGroup rows, then whole-panel groups up to
// kWholeUpTo). Otherwise the groups (and column tiles) take turns on each kBlockRows-row block of
// the panel: the block comes from memory for the first and from L1 for the rest, so the
// weight streams in while all compute. (At 16 lanes, 16 rows x 1 vector over the whole panel, then
// its other half, made each weight load serve half the FMAs: 1.35x the time at 16 rows.)
template <typename W, int R>
void PanelPass(const float* xt, const W* panel, float* y, int64_t K, int64_t N) {
  if constexpr ((R <= kFewWhole && kColTiles == 1) || (R <= kWholeGroup && R <= kWholeUpTo)) {
    Tile<W, R, R, kWholeAhead, false, kPanelVecs>(xt, panel, y, N, y, N, 0, K, true);  // one tile: the whole panel
  } else if constexpr (R <= kWholeUpTo) {
    for (int64_t k0 = 0; k0 < K; k0 += kBlockRows<W>)
      Groups<W, R, R, true, kPanelVecs, kWholeGroup>(xt, panel, y, N, k0, std::min(k0 + kBlockRows<W>, K));
  } else {
    for (int64_t k0 = 0; k0 < K; k0 += kBlockRows<W>) {
      const int64_t k1 = std::min(k0 + kBlockRows<W>, K);
      Groups<W, R, R, true>(xt, panel, y, N, k0, k1);
      for (int64_t c = 1; c < kColTiles; ++c)
        Groups<W, R, R, false>(xt, panel + c * kTileCols, y + c * kTileCols, N, k0, k1);
    }
  }
}

template <typename W>
using PassFn = void (*)(const float*, const W*, float*, int64_t, int64_t);
template <typename W, int... Rs>
constexpr PassFn<W> kPasses[] = {nullptr, &PanelPass<W, Rs>...};
template <typename W>
constexpr auto& kPassFor = kPasses<W, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16>;

// One row (a lone decode step) over S panels at once (`first`, first + apart, ...): each thread then
// reads S sequential weight streams, not one, and keeps more reads from memory in flight (a stand-alone
// two-thread test streaming 425 MB: 24-26 GB/s with two against 19-22 with one; the model's 30 layers
// of matmuls at one row, tools/time_matmuls.py --against: two 0.88-0.98x the time of one, mostly
// 0.90-0.94; eight 0.95-0.97x the time of two, AVX-512, and 3 or 4 about as 8; `bench --only decode`,
// alternating: 44.6 / 40.4 / 47.2 and 39.2 / 40.6 / 39.9 tok/s at 64 / 2000 against 43.5 / 44.2 / 39.7
// and 38.9 / 37.9 / 37.7). Each output is still one FMA chain over k. No software prefetch: the hardware
// prefetcher follows the streams, and dropping kAhead's prefetches (4 a k step) took 0.93-0.95x the
// time (35 GB/s of weights, a plain two-thread sum of 512 MB: 34-37).
template <typename W, int S>
void OneRowPanels(const float* x, const W* w, float* y, int64_t K, int64_t first, int64_t apart) {
  Vec acc[S][kPanelVecs] = {};
  const W* panel[S];
  for (int s = 0; s < S; ++s) panel[s] = w + (first + s * apart) * K * kPanel;
  for (int64_t k = 0; k < K; ++k) {
    const float xs = x[k];
    for (int v = 0; v < kPanelVecs; ++v)  // the streams' loads interleaved (a's first: 1.02x the time, AVX2)
      for (int s = 0; s < S; ++s) acc[s][v] += xs * LoadWeight(panel[s] + k * kPanel + kLanes * v);
  }
  for (int s = 0; s < S; ++s)
    for (int v = 0; v < kPanelVecs; ++v) Store(y + (first + s * apart) * kPanel + kLanes * v, acc[s][v]);
}
constexpr int kStreams = kVecRegs == 32 ? 8 : 2;  // panels side by side (AVX2: 4 vectors a panel, 16 registers)

template <typename W>
void FewRows(ffi::ThreadPool& pool, const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N) {
  FewRowsWith(pool, x, M, K, N, [w, y, M, K, N](const float* xt, int64_t p, int64_t end) {
    if (M == 1) {  // the run's panels in kStreams parts, read side by side
      const int64_t part_len = (end - p) / kStreams;
      for (int64_t i = p; i < p + part_len; ++i) OneRowPanels<W, kStreams>(xt, w, y, K, i, part_len);
      p += kStreams * part_len;
      const int64_t half = (end - p) / 2;
      for (int64_t i = p; i < p + half; ++i) OneRowPanels<W, 2>(xt, w, y, K, i, half);
      p += 2 * half;  // an odd one left: below
    }
    for (; p < end; ++p)
      for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass)  // a second pass finds the panel in cache
        kPassFor<W>[std::min(kRowsPerPass, M - m0)](xt + m0 * K, w + p * K * kPanel, y + m0 * N + p * kPanel, K, N);
  });
}

// ---- Many rows ----

// float32 panels: read in place (see ManyPanelsWith).
void ManyPanels(const float* xp, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t p0, int64_t p1) {
  ManyPanelsWith(xp, y, M, K, N, p0, p1, [w, K](int64_t p, int64_t k0, int64_t) { return w + (p * K + k0) * kPanel; });
}

constexpr int64_t kWidenPanels = 32;  // bfloat16: panels widened at a time (a 768 KB block of them)

// bfloat16 panels: rows k0..k0+kc of up to kWidenPanels panels at a time are widened once into
// scratch [panels, kc, 32] for all the row groups: at 6 rows a group, widening in the tile ran a
// 512-token prefill at 0.74x float32's speed.
void ManyPanels(const float* xp, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N, int64_t p0,
                int64_t p1) {
  for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
    const int64_t kc = std::min(kBlockK, K - k0);
    for (int64_t q0 = p0; q0 < p1; q0 += kWidenPanels) {
      const int64_t q1 = std::min(p1, q0 + kWidenPanels);
      float* const wide = ThreadScratch<3>((q1 - q0) * kc * kPanel);
      for (int64_t p = q0; p < q1; ++p)
        for (int64_t k = 0; k < kc; ++k)
          for (int64_t j = 0; j < kPanel; j += kLanes)
            Store(wide + ((p - q0) * kc + k) * kPanel + j, LoadWeight(w + (p * K + k0 + k) * kPanel + j));
      for (int64_t g = 0; g < M; g += kGroup) {
        const int64_t rows = std::min<int64_t>(kGroup, M - g);
        for (int64_t p = q0; p < q1; ++p)
          for (int64_t c = 0; c < kPanel; c += kTileCols)
            kTileFor[rows](xp + k0 * M + g * kc, wide + (p - q0) * kc * kPanel + c, y + g * N + p * kPanel + c, N,
                           y + g * N + p * kPanel + c, N, 0, kc, k0 == 0);
      }
    }
  }
}

template <typename W>
void ManyRows(ffi::ThreadPool& pool, const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N) {
  ManyRowsWith(pool, x, M, K, N, [=](const float* xp, int64_t p0, int64_t p1) { ManyPanels(xp, w, y, M, K, N, p0, p1); });
}

using Matrix = ffi::Buffer<ffi::F32, 2>;  // aliases: a template's comma would split the macro's arguments
using OutMatrix = ffi::ResultBuffer<ffi::F32, 2>;

// x float32, w packed float32 or bfloat16 (WeightType) as [L, N / 32, K, 32], of which layer `layer`
// is read in place; y float32.
template <ffi::DataType WeightType>
ffi::Error Matmul(ffi::ThreadPool pool, Matrix x, ffi::Buffer<WeightType, 4> w, LayerIndex layer, OutMatrix y) {
  using W = ffi::NativeType<WeightType>;
  const auto wd = w.dimensions();
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = wd[1] * kPanel, l = LayerOf(layer, wd[0]);
  if (K < 1 || l < 0 || wd[2] != K || wd[3] != kPanel || y->dimensions()[0] != M || y->dimensions()[1] != N)
    return ffi::Error::InvalidArgument("matmul: needs x [M, K], w packed [L, N / 32, K, 32], layer in 0..L-1, y [M, N]");
  (M < kManyFrom ? FewRows<W> : ManyRows<W>)(pool, x.typed_data(), w.typed_data() + l * N * K, y->typed_data(), M, K,
                                             N);
  return ffi::Error::Success();
}

using Panels = ffi::Buffer<ffi::F32, 4>;
using PanelsBf16 = ffi::Buffer<ffi::BF16, 4>;

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsmolMatmul, Matmul<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<Panels>()
                                  .Arg<LayerIndex>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsmolMatmulBf16, Matmul<ffi::BF16>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<PanelsBf16>()
                                  .Arg<LayerIndex>()
                                  .Ret<Matrix>());

// The build's vector width (cpu_kernels.h), part of the engine's fingerprint.
extern "C" int JaxsmolVectorLanes() { return kLanes; }
