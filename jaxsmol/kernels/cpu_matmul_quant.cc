// y[M, N] = x[M, K] @ w[K, N] in float32 with w in a quantized format (formats.py): Q8_0 (w = d q) or
// Q4_1 (w = d q + m), 32-column panels, one scale (and minimum) per 32 k's and column.
//
// Each weight is dequantized in registers to the float32 value formats.dequantize gives (d q is
// exact; Q4_1's one rounding of + m is the same with or without an FMA), and each output element is
// one FMA chain over k = 0..K-1 in order, as in cpu_matmul.cc: the same bits as the float32 kernel
// on the dequantized weights, whatever M.
#include "cpu_kernels.h"

namespace {

constexpr int64_t kPanel = 32, kBlock = 32;
constexpr int kPanelVecs = kPanel / kLanes;

typedef int8_t ByteVec __attribute__((vector_size(kLanes)));
typedef uint8_t UByteVec __attribute__((vector_size(kLanes)));

// kLanes weights of row k, columns kLanes v.. of a panel, as float32.
struct Q8_0 {
  const int8_t* q;  // [P, K, 32]
  const float* d;   // [P, K / 32, 32]
  inline Vec Load(int64_t p, int64_t K, int64_t k, int v) const {
    ByteVec b;
    std::memcpy(&b, q + (p * K + k) * kPanel + kLanes * v, sizeof b);
    return __builtin_convertvector(b, Vec) * ::Load(d + (p * (K / kBlock) + k / kBlock) * kPanel + kLanes * v);
  }
};

struct Q4_1 {
  const uint8_t* q;  // [P, K, 16]: byte j holds column j (low nibble) and j + 16 (high nibble)
  const float* d;    // [P, K / 32, 32]
  const float* m;    // [P, K / 32, 32]
  inline Vec Load(int64_t p, int64_t K, int64_t k, int v) const {
    const int64_t col = kLanes * v;
    UByteVec b;
    std::memcpy(&b, q + (p * K + k) * (kPanel / 2) + col % (kPanel / 2), sizeof b);
    b = col < kPanel / 2 ? (b & 0xF) : (b >> 4);
    const int64_t s = (p * (K / kBlock) + k / kBlock) * kPanel + col;
    return __builtin_convertvector(b, Vec) * ::Load(d + s) + ::Load(m + s);
  }
};

template <typename Q>
void Rows(ffi::ThreadPool& pool, const float* x, const Q& w, float* y, int64_t M, int64_t K, int64_t N) {
  ParallelFor(pool, N / kPanel, [=](int64_t p) {
    for (int64_t r = 0; r < M; ++r) {
      Vec acc[kPanelVecs] = {};
      for (int64_t k = 0; k < K; ++k) {
        const float xs = x[r * K + k];
        for (int v = 0; v < kPanelVecs; ++v) acc[v] += xs * w.Load(p, K, k, v);
      }
      for (int v = 0; v < kPanelVecs; ++v) Store(y + r * N + p * kPanel + kLanes * v, acc[v]);
    }
  });
}

using Matrix = ffi::Buffer<ffi::F32, 2>;
using OutMatrix = ffi::ResultBuffer<ffi::F32, 2>;
using Scales = ffi::Buffer<ffi::F32, 3>;
using CodesQ8 = ffi::Buffer<ffi::S8, 3>;  // aliases: a template's comma would split the macro's arguments
using CodesQ4 = ffi::Buffer<ffi::U8, 3>;

bool Shapes(const Matrix& x, int64_t P, int64_t K, int64_t q_cols, const ffi::Span<const int64_t> q, const Scales& d,
            OutMatrix& y) {
  return K % kBlock == 0 && q[1] == K && q[2] == q_cols && d.dimensions()[0] == P && d.dimensions()[1] == K / kBlock &&
         d.dimensions()[2] == kPanel && y->dimensions()[0] == x.dimensions()[0] && y->dimensions()[1] == P * kPanel;
}

ffi::Error MatmulQ8_0(ffi::ThreadPool pool, Matrix x, CodesQ8 q, Scales d, OutMatrix y) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], P = q.dimensions()[0];
  if (!Shapes(x, P, K, kPanel, q.dimensions(), d, y))
    return ffi::Error::InvalidArgument("matmul_q8_0: needs x [M, K], q [N / 32, K, 32], d [N / 32, K / 32, 32]");
  Rows(pool, x.typed_data(), Q8_0{q.typed_data(), d.typed_data()}, y->typed_data(), M, K, P * kPanel);
  return ffi::Error::Success();
}

ffi::Error MatmulQ4_1(ffi::ThreadPool pool, Matrix x, CodesQ4 q, Scales d, Scales m, OutMatrix y) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], P = q.dimensions()[0];
  if (!Shapes(x, P, K, kPanel / 2, q.dimensions(), d, y) || m.dimensions()[0] != P || m.dimensions()[1] != K / kBlock)
    return ffi::Error::InvalidArgument("matmul_q4_1: needs x [M, K], q [N / 32, K, 16], d and m [N / 32, K / 32, 32]");
  Rows(pool, x.typed_data(), Q4_1{q.typed_data(), d.typed_data(), m.typed_data()}, y->typed_data(), M, K, P * kPanel);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsmolMatmulQ8_0, MatmulQ8_0,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<CodesQ8>()
                                  .Arg<Scales>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsmolMatmulQ4_1, MatmulQ4_1,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<CodesQ4>()
                                  .Arg<Scales>()
                                  .Arg<Scales>()
                                  .Ret<Matrix>());
