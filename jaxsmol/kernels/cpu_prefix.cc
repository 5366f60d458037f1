// A restored prefix written into a cache buffer in place, for Engine.restore (cpu_kernels.py):
// out [L, B, K, S, H] (the donated cache, aliased) gets prefix [L, B, K, P, H] at slots 0..P-1.
//
// Why: XLA:CPU's dynamic-update-slice copies on one thread; a 1008-position prefix of SmolLM2-135M
// (2 x 24 MB) took 8 ms of a 61-67 ms warm time to first token. Here each (layer, row, kv head) is
// one memcpy, the rows split between the threads. A copy: no bits change.
#include "cpu_kernels.h"

namespace {

ffi::Error LoadPrefix(ffi::ThreadPool pool, ffi::AnyBuffer cache, ffi::AnyBuffer prefix,
                      ffi::Result<ffi::AnyBuffer> out) {
  const auto cd = cache.dimensions(), pd = prefix.dimensions();
  if (cd.size() != 5 || pd.size() != 5 || prefix.element_type() != cache.element_type() || pd[0] != cd[0] ||
      pd[1] != cd[1] || pd[2] != cd[2] || pd[4] != cd[4] || pd[3] > cd[3] || out->untyped_data() != cache.untyped_data())
    return ffi::Error::InvalidArgument("load prefix: needs cache [L, B, K, S, H] (aliased to the result) and a "
                                       "prefix [L, B, K, P <= S, H] of its dtype");
  const int64_t rows = cd[0] * cd[1] * cd[2];
  const size_t piece = prefix.size_bytes() / rows, stride = cache.size_bytes() / rows;  // bytes of P and S slots
  char* const dst = static_cast<char*>(out->untyped_data());
  const char* const src = static_cast<const char*>(prefix.untyped_data());
  const int64_t tasks = std::min<int64_t>(rows, 4 * std::max<int64_t>(1, pool.num_threads()));
  ParallelFor(pool, tasks, [=](int64_t t) {
    for (int64_t r = rows * t / tasks; r < rows * (t + 1) / tasks; ++r) std::memcpy(dst + r * stride, src + r * piece, piece);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsmolLoadPrefix, LoadPrefix,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
