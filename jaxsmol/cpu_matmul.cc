// y[M, N] = x[M, K] @ w[K, N] in float32 for the jitted forward (cpu_kernels.py): every matmul of the
// model, decode steps and prefill chunks alike.
//
// Summation order: every output element is one fused multiply-add chain over k = 0, 1, ..., K-1,
// whatever M, the path below, the thread count or the tiling. So a row's bits do not depend on how
// many other rows share the call: a decode row is batch-invariant, and a prompt row gets the same
// bits in a chunk of 16 rows as in one of 512 (what lets the prefix cache stay exact with short
// chunks; XLA:CPU's GEMM sums differently below 64 rows).
//
// Two paths, by row count:
// - Few rows (decode steps, M < kPackFrom). XLA:CPU (like OpenBLAS) packs a panel of the weight
//   before every product; at 2-16 rows that packing costs more than the arithmetic, so an 8-row
//   decode step cost 2.6x a one-row step although both stream the same weights. This path reads
//   each weight row once, straight from the [K, N] row-major array, and applies it to every row
//   while it is in registers. The N columns are cut into panels (about N / threads).
// - Many rows (prefill chunks). BLIS's blocking: x packed once into groups of 14 rows, k-major;
//   per thread a kPackK-row block of its columns of w packed into 32-column panels (a panel's rows
//   adjacent, read sequentially from L1); a 14 x 32 register tile (28 accumulators) over that block,
//   loaded from y and stored back between blocks, so each element is still one chain in k order.
//   Measured in the model (prefill 1024 in 512-row chunks, one process, alternating): 1.03x the
//   speed of XLA's GEMM; 1.3x the few-rows path at 32 rows; 0.7-0.9x it for 8-16-row decode steps,
//   whose weights come from memory, hence the split.
#include "cpu_kernels.h"

namespace {

constexpr int64_t kRowsPerPass = 16;  // few rows: rows held in registers at once (more: another pass)
constexpr int64_t kBlockK = 16;       // few rows: weight rows per register block; 8-64 measured
constexpr int64_t kMaxPanel = 1024;
constexpr int64_t kPackFrom = 32;     // from this many rows on, the packed path

// ---- Few rows ----

// Columns per register block: fewer rows leave registers for more independent accumulators.
constexpr int TilesFor(int rows) { return rows >= 8 ? 1 : rows >= 4 ? 2 : rows >= 2 ? 4 : 8; }

// y[0:R, n:n + 16 T] += xt[k0:k1] @ w[k0:k1, n:n + 16 T], the accumulators held in registers.
template <int R, int T>
inline void Block(const float* xt, const float* w, float* y, int64_t N, int64_t k0, int64_t k1, int64_t n) {
  Vec acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = k0 ? Load(y + r * N + n + kLanes * t) : Vec{};
  for (int64_t k = k0; k < k1; ++k) {
    Vec wk[T];
    for (int t = 0; t < T; ++t) wk[t] = Load(w + k * N + n + kLanes * t);
    for (int r = 0; r < R; ++r) {
      const float xs = xt[k * R + r];
      for (int t = 0; t < T; ++t) acc[r][t] += xs * wk[t];  // contracted to one FMA
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) Store(y + r * N + n + kLanes * t, acc[r][t]);
}

// y[0:R, n0:n1] for one pass of R rows; xt is that pass's rows transposed, [K, R]. The k blocks are
// the outer loop so that the weight is read as kBlockK sequential streams, each row once.
template <int R>
void Panel(const float* xt, const float* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  constexpr int T = TilesFor(R);
  for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
    const int64_t k1 = std::min(k0 + kBlockK, K);
    int64_t n = n0;
    for (; n + kLanes * T <= n1; n += kLanes * T) Block<R, T>(xt, w, y, N, k0, k1, n);
    for (; n < n1; n += kLanes) Block<R, 1>(xt, w, y, N, k0, k1, n);  // a panel's last columns
  }
}

using PanelFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
template <int... Rs>
constexpr PanelFn kPanels[] = {nullptr, &Panel<Rs>...};
constexpr auto& kPanelFor = kPanels<1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16>;

void FewRows(ffi::ThreadPool& pool, const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N) {
  // each pass of <= 16 rows transposed to [K, rows], so a k step's rows are adjacent
  std::vector<float> xt(M * K);
  for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
    const int64_t rows = std::min(kRowsPerPass, M - m0);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t r = 0; r < rows; ++r) xt[m0 * K + k * rows + r] = x[(m0 + r) * K + k];
  }
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t block = kLanes * TilesFor(static_cast<int>(std::min(M, kRowsPerPass)));
  int64_t panel = std::min(kMaxPanel, (N + threads - 1) / threads);
  panel = std::max(block, (panel + block - 1) / block * block);
  ParallelFor(pool, (N + panel - 1) / panel, [&xt, w, y, M, K, N, panel](int64_t p) {
    const int64_t n0 = p * panel, n1 = std::min(n0 + panel, N);
    for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
      const int64_t rows = std::min(kRowsPerPass, M - m0);
      kPanelFor[rows](xt.data() + m0 * K, w, y + m0 * N, K, N, n0, n1);
    }
  });
}

// ---- Many rows ----

constexpr int kGroup = 14, kPanelVecs = 2;  // the register tile: 14 rows x 2 vectors
constexpr int64_t kPanelCols = kLanes * kPanelVecs;
constexpr int64_t kPackK = 192;  // weight rows per packed block: a 24 KB panel stays in L1; 96-576 measured
constexpr int64_t kPrefetch = 8;  // k steps ahead: 1.07x the speed of none in the model (16: the same)

// y[0:R, 0:16 V] (row stride N) over one packed block: xp [kc, R], wp [kc, 16 V]; `first` starts
// the chains at 0, otherwise they continue from y.
template <int R, int V>
inline void Tile(const float* xp, const float* wp, float* y, int64_t N, int64_t kc, bool first) {
  Vec acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = first ? Vec{} : Load(y + r * N + kLanes * v);
  for (int64_t k = 0; k < kc; ++k) {
    for (int v = 0; v < V; ++v) __builtin_prefetch(wp + (k + kPrefetch) * kLanes * V + kLanes * v);
    __builtin_prefetch(xp + (k + kPrefetch) * R);
    Vec wk[V];
    for (int v = 0; v < V; ++v) wk[v] = Load(wp + k * kLanes * V + kLanes * v);
    for (int r = 0; r < R; ++r) {
      const float xs = xp[k * R + r];
      for (int v = 0; v < V; ++v) acc[r][v] += xs * wk[v];  // contracted to one FMA
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) Store(y + r * N + kLanes * v, acc[r][v]);
}

template <int R>
void TileAny(const float* xp, const float* wp, float* y, int64_t N, int64_t kc, bool first, int vecs) {
  if (vecs == kPanelVecs) Tile<R, kPanelVecs>(xp, wp, y, N, kc, first);
  else Tile<R, 1>(xp, wp, y, N, kc, first);
}
using TileFn = void (*)(const float*, const float*, float*, int64_t, int64_t, bool, int);
template <int... Rs>
constexpr TileFn kTiles[] = {nullptr, &TileAny<Rs>...};
constexpr auto& kTileFor = kTiles<1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14>;

// Rows g0..g0+rows of x [M, K] -> one group of xp, k-major over the whole K: xp[g0 K + k rows + r].
void PackRows(const float* x, float* xp, int64_t K, int64_t g0, int64_t rows) {
  const float* src = x + g0 * K;
  float* dst = xp + g0 * K;
  for (int64_t k = 0; k < K; ++k)
    for (int64_t r = 0; r < rows; ++r) dst[k * rows + r] = src[r * K + k];
}

// y[:, n0:n1] = x @ w[:, n0:n1], x packed by PackRows.
void PackedPart(const float* xp, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  // per-thread scratch kept between calls: a fresh allocation of this size is a fresh mapping, whose
  // page faults cost more than the packing
  thread_local std::vector<float> scratch;
  if (scratch.size() < static_cast<size_t>(kPackK * (n1 - n0))) scratch.resize(kPackK * (n1 - n0));
  float* wp = scratch.data();
  for (int64_t k0 = 0; k0 < K; k0 += kPackK) {
    const int64_t kc = std::min(kPackK, K - k0);
    for (int64_t n = n0; n < n1; n += kPanelCols) {
      const int64_t vecs = std::min(kPanelCols, n1 - n) / kLanes;
      float* dst = wp + (n - n0) * kc;
      for (int64_t k = 0; k < kc; ++k)
        for (int64_t v = 0; v < vecs; ++v) Store(dst + (k * vecs + v) * kLanes, Load(w + (k0 + k) * N + n + v * kLanes));
    }
    for (int64_t g = 0; g < M; g += kGroup) {
      const int64_t rows = std::min<int64_t>(kGroup, M - g);
      for (int64_t n = n0; n < n1; n += kPanelCols)
        kTileFor[rows](xp + g * K + k0 * rows, wp + (n - n0) * kc, y + g * N + n, N, kc, k0 == 0,
                       static_cast<int>(std::min(kPanelCols, n1 - n) / kLanes));
    }
  }
}

// x packed once (its row groups split between the threads), then the columns split between the
// threads in whole 16-column vectors.
void ManyRows(ffi::ThreadPool& pool, const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N) {
  thread_local std::vector<float> packed;  // the caller's: pool threads read it only during this call
  if (packed.size() < static_cast<size_t>(M * K)) packed.resize(M * K);
  float* xp = packed.data();
  ParallelFor(pool, (M + kGroup - 1) / kGroup,
              [=](int64_t g) { PackRows(x, xp, K, g * kGroup, std::min<int64_t>(kGroup, M - g * kGroup)); });
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t part = (N / kLanes + threads - 1) / threads * kLanes;
  ParallelFor(pool, (N + part - 1) / part,
              [=](int64_t p) { PackedPart(xp, w, y, M, K, N, p * part, std::min(N, (p + 1) * part)); });
}

using Matrix = ffi::Buffer<ffi::F32, 2>;  // aliases: a template's comma would split the macro's arguments
using OutMatrix = ffi::ResultBuffer<ffi::F32, 2>;

ffi::Error Matmul(ffi::ThreadPool pool, Matrix x, Matrix w, OutMatrix y) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = w.dimensions()[1];
  if (w.dimensions()[0] != K || y->dimensions()[0] != M || y->dimensions()[1] != N || N % kLanes)
    return ffi::Error::InvalidArgument("matmul: needs x [M, K], w [K, N], y [M, N], N % 16 == 0");
  (M < kPackFrom ? FewRows : ManyRows)(pool, x.typed_data(), w.typed_data(), y->typed_data(), M, K, N);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsmolMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<Matrix>()
                                  .Ret<Matrix>());
