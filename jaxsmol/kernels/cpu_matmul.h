// What the float32 matmul (cpu_matmul.cc) and the quantized one (cpu_matmul_quant.cc) share: the
// packed layout's constants, the register tile every path runs, the few-row passes' transposition
// and split between threads, and the many-row path (x packed, then panel blocks under the tiles).
// Whatever supplies a block of float32 weight rows (in place, widened, dequantized), each output
// element stays one FMA chain over k = 0..K-1 in order (see cpu_matmul.cc).
#pragma once

#include "cpu_kernels.h"

#include <array>
#include <utility>

namespace {

constexpr int64_t kPanel = 32;       // columns per weight panel (the packed layout)
constexpr int kTileVecs = 2;         // vectors per row of a register tile: the whole panel at 16 lanes
constexpr int64_t kTileCols = kTileVecs * kLanes;  // ... half of it at 8 (AVX2: 16 registers)
constexpr int64_t kColTiles = kPanel / kTileCols;
constexpr int64_t kAhead = 64;       // few rows: prefetch distance in weight rows (8 KB; 16: 1.02-1.10x slower)
// A tile streaming its panel from memory (few rows; the first row group of a block in the tiled
// path): a second prefetch, into L2, this many rows ahead (32 KB of a float32 panel; past its end it
// reaches the thread's next panel or block). A prefetch into L1 can only
// keep as many lines in flight as L1 has fill buffers; L2 takes more, and the stream's rate follows
// (tools/time_matmuls.py --against, AVX-512: 4 / 8 / 12 rows 0.90-0.94x the time at 256, 128 and 512
// alike; 2 rows 0.98-1.0x; bfloat16 2-8 rows 0.86-0.93x; tiled: 17-64 rows 0.87-0.97x in all but
// one of 8 runs, 512 rows 0.99x). The one-row path (OneRowPanels) took 1.02-1.06x with it.
constexpr int64_t kFar = 256;

constexpr int64_t kRowsPerPass = 16; // few rows: rows transposed together (more: another pass)
// From this many rows on, the tiled path. AVX2: a 16-row decode step's matmuls in one few-row pass
// took 0.90-0.91x the tiled time (float32 and bfloat16), 20-32 rows 1.07-1.15x. AVX-512: 16 rows in
// one few-row pass (with kFar) 0.94x the tiled time (bfloat16 0.66x).
constexpr int64_t kManyFrom = kRowsPerPass + 1;
constexpr int kPanelVecs = kPanel / kLanes;  // vectors per panel row
// Panels a thread claims at a time (ParallelForShares): few enough that a thread whose core is taken
// away holds up little, enough for the one-row path's side-by-side streams.
constexpr int64_t kRunPanels = 8;

alignas(64) constexpr float kZeros[kPanel] = {};  // the chains' start: one panel row of zeros

// The one register tile every path runs: y[0:R, 0:V kLanes] (V = kTileVecs unless told; row stride
// N) over rows k0..k1 of a panel (its rows kPanel apart; `panel` may point into it by a column
// offset), x given k-major as xt[k LD + r]. `first` starts the chains at 0, otherwise they continue
// from y_in (row stride in_stride: y itself, or the many-row path's scratch between k blocks), so
// each element stays one FMA chain in k order whatever the blocking. Ahead > 0 prefetches
// the panel's row (all its 32 columns: with two column tiles, the first one's prefetch serves both),
// and x with PrefetchX, that many rows on.
template <typename W, int R, int LD, int64_t Ahead, bool PrefetchX, int V = kTileVecs>
inline void Tile(const float* xt, const W* panel, const float* y_in, int64_t in_stride, float* y, int64_t N,
                 int64_t k0, int64_t k1, bool first) {
  Vec acc[R][V];
  if (first) y_in = kZeros, in_stride = 0;  // a load either way: no branch for the accumulators to merge across
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = Load(y_in + r * in_stride + kLanes * v);
  int64_t k = k0;
  do {  // k1 > k0 always
    if constexpr (Ahead > 0)
      for (int64_t c = 0; c < kPanel; c += 64 / sizeof(W)) __builtin_prefetch(panel + (k + Ahead) * kPanel + c);  // 64-byte lines
    if constexpr (Ahead > 0)  // into L2 too, from further on (see kFar)
      for (int64_t c = 0; c < kPanel; c += 64 / sizeof(W)) __builtin_prefetch(panel + (k + kFar) * kPanel + c, 0, 2);
    if constexpr (PrefetchX) __builtin_prefetch(xt + (k + Ahead) * LD);
    Vec wk[V];
    for (int v = 0; v < V; ++v) wk[v] = LoadWeight(panel + k * kPanel + kLanes * v);
    for (int r = 0; r < R; ++r) {
      const float xs = xt[k * LD + r];
      for (int v = 0; v < V; ++v) acc[r][v] += xs * wk[v];  // contracted to one FMA
    }
  } while (++k < k1);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) Store(y + r * N + kLanes * v, acc[r][v]);
}

// ---- Few rows ----

// x [M, K] in passes of up to kRowsPerPass rows, each transposed to [K, rows] (a k step's rows
// adjacent: pass m0 at xt + m0 K), then fn(xt, p0, p1) on runs of panels p0..p1-1 (ParallelForShares).
template <typename Fn>
void FewRowsWith(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, int64_t N, Fn fn) {
  float* const xt = ThreadScratch<1>(M * K);
  for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
    const int64_t rows = std::min(kRowsPerPass, M - m0);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t r = 0; r < rows; ++r) xt[m0 * K + k * rows + r] = x[(m0 + r) * K + k];
  }
  ParallelForShares(pool, N / kPanel, kRunPanels, [xt, fn](int64_t p0, int64_t p1, bool) { fn(xt, p0, p1); });
}

// ---- Many rows ----

// The register tile: as many rows of 2 accumulators as fit beside the weight's 2 vectors and x's
// broadcast (14 with 32 registers, 6 with 16).
constexpr int kGroup = (kVecRegs - kTileVecs - 1) / kTileVecs;
constexpr int64_t kBlockK = 192;  // panel rows per block: 24 KB stays in L1; 96-576 measured
constexpr int64_t kPrefetch = 32;  // k steps ahead; with x block-major, 0.92-0.97x the time of 8 at 512 rows (16: 0.97x)

// One block (rows k0..k1) of one panel for one group of R rows of xp (k-major, R apart).
using TileFn = void (*)(const float*, const float*, const float*, int64_t, float*, int64_t, int64_t, int64_t, bool);
template <int... Rs>
constexpr TileFn kTiles[] = {nullptr, &Tile<float, Rs, Rs, kPrefetch, true>...};
constexpr auto& kTileFor = kTiles<1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14>;


// v[r][j] -> v[j][r] for a kLanes x kLanes block: one stage per bit of the index, each swapping
// that bit between row and column (two-input shuffles: vpermt2ps and the like).
using Lanes = int32_t __attribute__((vector_size(kLanes * sizeof(int32_t))));
template <int D, int... J>
inline void TransposeStage(Vec* v, std::integer_sequence<int, J...>) {
  constexpr Lanes low = {((J & D) ? kLanes + J - D : J)...}, high = {((J & D) ? kLanes + J : J + D)...};
  for (int i = 0; i < kLanes; ++i)
    if (!(i & D)) {
      const Vec a = v[i], b = v[i + D];
      v[i] = __builtin_shuffle(a, b, low);
      v[i + D] = __builtin_shuffle(a, b, high);
    }
}
template <int... B>
inline void TransposeStages(Vec* v, std::integer_sequence<int, B...>) {
  (TransposeStage<1 << B>(v, std::make_integer_sequence<int, kLanes>{}), ...);
}
inline void Transpose(Vec* v) { TransposeStages(v, std::make_integer_sequence<int, kLanes == 16 ? 4 : 3>{}); }

// Rows g0..g0+rows of x [M, K] -> one group of xp, k-major within each k block: block k0's groups
// follow one another (xp[k0 M + g0 kc + (k - k0) rows + r]), so a pass over a block's groups reads
// x as one sequential stream that the prefetches run along into the next group.
// kLanes columns of kLanes rows at a time go through the registers (Transpose); a scalar copy took
// 6% of a 1536-deep product's time at 512 rows.
void PackRows(const float* x, float* xp, int64_t M, int64_t K, int64_t g0, int64_t rows) {
  const float* src = x + g0 * K;
  for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
    const int64_t kc = std::min(kBlockK, K - k0);
    float* dst = xp + k0 * M + g0 * kc;
    int64_t k = 0;
    for (; k + kLanes <= kc; k += kLanes) {
      Vec v[kLanes];
      for (int r = 0; r < kLanes; ++r) v[r] = Load(src + std::min<int64_t>(r, rows - 1) * K + k0 + k);
      Transpose(v);
      // Whole vectors, in k order: each one's lanes past `rows` land where the next ones' go; near
      // the block's end only its own rows (what follows may be the next group, another thread's).
      for (int j = 0; j < kLanes; ++j)
        if ((k + j) * rows + kLanes <= kc * rows) Store(dst + (k + j) * rows, v[j]);
        else std::memcpy(dst + (k + j) * rows, &v[j], rows * sizeof(float));
    }
    for (; k < kc; ++k)
      for (int64_t r = 0; r < rows; ++r) dst[k * rows + r] = src[r * K + k0 + k];
  }
}

// y[:, 32 p0 : 32 p1] = x @ those panels of w, x packed by PackRows; float32 panels are read in
// place, panel by panel and each one's k blocks in order, so a thread's panels are one sequential
// stream (they are adjacent in the packed layout). With the k blocks outermost (as bfloat16 does
// in cpu_matmul.cc) the stream jumped ~73-196 KB after each 24 KB block; side by side (tools/time_matmuls.py
// --against): 0.95-0.97x the time at 16-24 rows, 0.98x at 64 and 512. A tile's sums between k blocks
// go to `part` ([M, 32], contiguous) rather than to y's rows (N apart, 14 pages per tile), and only
// the last block stores to y; with x block-major (PackRows) that took 0.96x / 0.89x / 0.90x the time
// at 512 / 64 / 24 rows (bits unchanged). Tried and not kept: blocking the rows so that x stays in L2
// for the 1536-deep product (no change).
// block(p, k0, kc): rows k0..k0+kc-1 of panel p as float32 [kc, 32] (in place, or a scratch the
// caller fills: then kept until the next call).
template <typename Block>
void ManyPanelsWith(const float* xp, float* y, int64_t M, int64_t K, int64_t N, int64_t p0, int64_t p1, Block block) {
  float* const part = ThreadScratch<4>(M * kPanel);  // [M, 32]: the panel's sums between k blocks
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
      const int64_t kc = std::min(kBlockK, K - k0);
      const bool last = k0 + kc == K;
      const float* const wk = block(p, k0, kc);
      for (int64_t g = 0; g < M; g += kGroup) {
        const int64_t rows = std::min<int64_t>(kGroup, M - g);
        float* const out = last ? y + g * N + p * kPanel : part + g * kPanel;
        for (int64_t c = 0; c < kPanel; c += kTileCols)
          kTileFor[rows](xp + k0 * M + g * kc, wk + c, part + g * kPanel + c, kPanel, out + c, last ? N : kPanel,
                         0, kc, k0 == 0);
      }
    }
}

// x packed once (its row groups split between the threads), then panels(xp, p0, p1) on runs of
// panels (ParallelForShares).
template <typename Panels>
void ManyRowsWith(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, int64_t N, Panels panels) {
  float* const xp = ThreadScratch<2>(M * K);
  ParallelFor(pool, (M + kGroup - 1) / kGroup,
              [=](int64_t g) { PackRows(x, xp, M, K, g * kGroup, std::min<int64_t>(kGroup, M - g * kGroup)); });
  ParallelForShares(pool, N / kPanel, kRunPanels, [xp, panels](int64_t p0, int64_t p1, bool) { panels(xp, p0, p1); });
}

// ---- Quantized operands ----

constexpr int64_t kBlock = 32;  // k's per scale (and minimum): GGUF's blocks

using Matrix = ffi::Buffer<ffi::F32, 2>;
using OutMatrix = ffi::ResultBuffer<ffi::F32, 2>;
using Scales = ffi::Buffer<ffi::F32, 4>;
using CodesQ8 = ffi::Buffer<ffi::S8, 4>;  // aliases: a template's comma would split the macro's arguments
using CodesQ4 = ffi::Buffer<ffi::U8, 4>;

// A quantized matmul's operands (cpu_matmul_quant.cc, cpu_matmul_int8.cc), every one stacked over the layers ([L, ...]), of which layer l is read in place: -> (l, P, K),
// l = -1 where a shape disagrees.
inline std::array<int64_t, 3> QuantShapes(const Matrix& x, const LayerIndex& layer, int64_t q_cols, const ffi::Span<const int64_t> q,
                              const Scales& d, const Scales* m, OutMatrix& y) {
  const int64_t L = q[0], P = q[1], K = x.dimensions()[1];
  const auto dd = d.dimensions();
  const bool scales = dd[0] == L && dd[1] == P && dd[2] == K / kBlock && dd[3] == kPanel &&
                      (m == nullptr || std::equal(dd.begin(), dd.end(), m->dimensions().begin()));
  const bool ok = K >= kBlock && K % kBlock == 0 && q[2] == K && q[3] == q_cols && scales &&
                  y->dimensions()[0] == x.dimensions()[0] && y->dimensions()[1] == P * kPanel;
  return {ok ? LayerOf(layer, L) : -1, P, K};
}

// Their FFI bindings: the exact and the integer-dot handlers take the same operands.
inline auto BindQ8_0() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<Matrix>().Arg<CodesQ8>().Arg<Scales>().Arg<LayerIndex>().Ret<Matrix>();
}
inline auto BindQ4_1() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<Matrix>()
      .Arg<CodesQ4>()
      .Arg<Scales>()
      .Arg<Scales>()
      .Arg<LayerIndex>()
      .Ret<Matrix>();
}

}  // namespace
