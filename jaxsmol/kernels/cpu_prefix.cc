// Copies into and within KV caches, for the jitted programs (cpu_kernels.py), and the KV arena's memory:
//
// - LoadPrefix: Engine.restore's snapshot prefix written into a one-sequence cache, in place.
// - WriteSlots: a staged block of a host snapshot written into one row of the KV arena at a position
//   (jaxsmol/runtime/kv_arena.py: a restore is a few such blocks).
// - ReadSlots: a block of a row read out, no slot past the positions asked (a save into the prefix cache).
// - CopyRow: the first n slots of one arena row copied into another (a prompt's forks).
// - WriteRows: a chunk's new keys or values written into one layer of a bfloat16 cache, in place (XLA:CPU
//   widens a bfloat16 dynamic-update-slice to float32: the whole cache converted there and back at every
//   layer of every step, seconds a step on a daemon's arena).
// - Reserve: the arena itself, [L, R, K, S, H] allocated and not touched: its whole pages are handed back
//   to the OS (they read as zeros and take no memory until a program writes them), so the arena's
//   resident memory is the positions its rows have written, not R x S.
//
// Why kernels: XLA:CPU's dynamic-update-slice copies on one thread; a 1008-position prefix of
// SmolLM2-135M (2 x 24 MB) took 8 ms of a 61-67 ms warm time to first token. Here each (layer, row,
// kv head) is one memcpy, the slabs split between the threads. A copy: no bits change. And XLA cannot
// allocate memory without writing it: the arena as zeros touched every page of it.
#include <sys/mman.h>
#include <unistd.h>

#include "cpu_kernels.h"

namespace {

// Split `pieces` memcpys between the threads.
template <typename Fn>
void CopyPieces(ffi::ThreadPool& pool, int64_t pieces, Fn copy) {
  const int64_t tasks = std::min<int64_t>(pieces, 4 * std::max<int64_t>(1, pool.num_threads()));
  if (tasks <= 0) return;
  ParallelFor(pool, tasks, [=](int64_t t) {
    for (int64_t r = pieces * t / tasks; r < pieces * (t + 1) / tasks; ++r) copy(r);
  });
}

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
  CopyPieces(pool, rows, [=](int64_t r) { std::memcpy(dst + r * stride, src + r * piece, piece); });
  return ffi::Error::Success();
}

using Where = ffi::Buffer<ffi::S32, 1>;

// out = cache [L, R, K, S, H] (aliased) with the first at[2] <= P slots of block [L, 1, K, P, H] written
// into row at[0] from slot at[1] (at[1] + P <= S): the block's padding past them is not written, so a
// restore backs no page past the prefix it copies.
ffi::Error WriteSlots(ffi::ThreadPool pool, ffi::AnyBuffer cache, ffi::AnyBuffer block, Where at,
                      ffi::Result<ffi::AnyBuffer> out) {
  const auto cd = cache.dimensions(), bd = block.dimensions();
  const int32_t* w = at.typed_data();
  if (cd.size() != 5 || bd.size() != 5 || block.element_type() != cache.element_type() || bd[0] != cd[0] ||
      bd[1] != 1 || bd[2] != cd[2] || bd[4] != cd[4] || at.dimensions()[0] != 3 ||
      out->untyped_data() != cache.untyped_data())
    return ffi::Error::InvalidArgument("write slots: needs cache [L, R, K, S, H] (aliased to the result), a block "
                                       "[L, 1, K, P, H] of its dtype and (row, start, slots)");
  if (w[0] < 0 || w[0] >= cd[1] || w[1] < 0 || w[1] + bd[3] > cd[3] || w[2] < 0 || w[2] > bd[3])
    return ffi::Error::InvalidArgument("write slots: the block does not fit the row at that position");
  const int64_t L = cd[0], R = cd[1], K = cd[2], S = cd[3], P = bd[3];
  const size_t slot = cache.size_bytes() / (L * R * K * S), piece = w[2] * slot;
  char* const dst = static_cast<char*>(out->untyped_data());
  const char* const src = static_cast<const char*>(block.untyped_data());
  const int64_t row = w[0], start = w[1];
  CopyPieces(pool, L * K, [=](int64_t i) {  // i = l K + k: slab (l, row, k) of the cache, (l, 0, k) of the block
    const int64_t l = i / K, k = i % K;
    std::memcpy(dst + (((l * R + row) * K + k) * S + start) * slot, src + i * P * slot, piece);
  });
  return ffi::Error::Success();
}

// out = block [L, 1, K, P, H]: slots at[1]..at[1] + at[2] - 1 of row at[0] of cache [L, R, K, S, H], zeros
// past them (at[2] <= P): a save reads no slot past the positions it stores (a read of a page never
// written maps the OS's zero page, which the arena's count of its resident pages would take for KV).
ffi::Error ReadSlots(ffi::ThreadPool pool, ffi::AnyBuffer cache, Where at, ffi::Result<ffi::AnyBuffer> out) {
  const auto cd = cache.dimensions(), od = out->dimensions();
  const int32_t* w = at.typed_data();
  if (cd.size() != 5 || od.size() != 5 || out->element_type() != cache.element_type() || od[0] != cd[0] ||
      od[1] != 1 || od[2] != cd[2] || od[4] != cd[4] || at.dimensions()[0] != 3)
    return ffi::Error::InvalidArgument("read slots: needs cache [L, R, K, S, H], a result [L, 1, K, P, H] of its "
                                       "dtype and (row, start, slots)");
  if (w[0] < 0 || w[0] >= cd[1] || w[1] < 0 || w[2] < 0 || w[2] > od[3] || w[1] + w[2] > cd[3])
    return ffi::Error::InvalidArgument("read slots: the slots are outside the row");
  const int64_t L = cd[0], R = cd[1], K = cd[2], S = cd[3], P = od[3];
  const size_t slot = cache.size_bytes() / (L * R * K * S), piece = w[2] * slot;
  const char* const src = static_cast<const char*>(cache.untyped_data());
  char* const dst = static_cast<char*>(out->untyped_data());
  const int64_t row = w[0], start = w[1];
  CopyPieces(pool, L * K, [=](int64_t i) {
    const int64_t l = i / K, k = i % K;
    std::memcpy(dst + i * P * slot, src + (((l * R + row) * K + k) * S + start) * slot, piece);
    std::memset(dst + i * P * slot + piece, 0, (P * slot) - piece);
  });
  return ffi::Error::Success();
}

// out = cache [L, R, K, S, H] (aliased) with the first at[2] slots of row at[0] copied into row at[1].
ffi::Error CopyRow(ffi::ThreadPool pool, ffi::AnyBuffer cache, Where at, ffi::Result<ffi::AnyBuffer> out) {
  const auto cd = cache.dimensions();
  const int32_t* w = at.typed_data();
  if (cd.size() != 5 || at.dimensions()[0] != 3 || out->untyped_data() != cache.untyped_data())
    return ffi::Error::InvalidArgument("copy row: needs cache [L, R, K, S, H] (aliased to the result) and "
                                       "(from, to, slots)");
  const int64_t L = cd[0], R = cd[1], K = cd[2], S = cd[3];
  if (w[0] < 0 || w[0] >= R || w[1] < 0 || w[1] >= R || w[2] < 0 || w[2] > S)
    return ffi::Error::InvalidArgument("copy row: rows or slots outside the cache");
  if (w[0] == w[1] || w[2] == 0) return ffi::Error::Success();
  const size_t slot = cache.size_bytes() / (L * R * K * S), piece = w[2] * slot;
  char* const base = static_cast<char*>(out->untyped_data());
  const int64_t from = w[0], to = w[1];
  CopyPieces(pool, L * K, [=](int64_t i) {
    const int64_t l = i / K, k = i % K;
    std::memcpy(base + ((l * R + to) * K + k) * S * slot, base + ((l * R + from) * K + k) * S * slot, piece);
  });
  return ffi::Error::Success();
}

// out = cache [L, R, K, S, H] (aliased) with new [B, T, K, H] written into layer `layer`: row b of new
// into cache row rows[b], slots pos[b]..pos[b] + T - 1. A chunk's few rows: one thread, a memcpy per slot.
using Index = ffi::Buffer<ffi::S32, 0>;

ffi::Error WriteRows(ffi::AnyBuffer cache, ffi::AnyBuffer fresh, Where rows, Where pos, Index layer,
                     ffi::Result<ffi::AnyBuffer> out) {
  const auto cd = cache.dimensions(), nd = fresh.dimensions();
  if (cd.size() != 5 || nd.size() != 4 || fresh.element_type() != cache.element_type() || nd[2] != cd[2] ||
      nd[3] != cd[4] || rows.dimensions()[0] != nd[0] || pos.dimensions()[0] != nd[0] ||
      out->untyped_data() != cache.untyped_data())
    return ffi::Error::InvalidArgument("write rows: needs cache [L, R, K, S, H] (aliased to the result), new "
                                       "[B, T, K, H] of its dtype, rows [B] and positions [B]");
  const int64_t L = cd[0], R = cd[1], K = cd[2], S = cd[3], B = nd[0], T = nd[1];
  const int64_t l = *layer.typed_data();
  const size_t slot = cache.size_bytes() / (L * R * K * S);  // bytes of one slot: H elements
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("write rows: the layer is outside the cache");
  for (int64_t b = 0; b < B; ++b) {
    const int64_t r = rows.typed_data()[b], p = pos.typed_data()[b];
    if (r < 0 || r >= R || p < 0 || p + T > S)
      return ffi::Error::InvalidArgument("write rows: a row or its slots are outside the cache");
  }
  char* const dst = static_cast<char*>(out->untyped_data());
  const char* const src = static_cast<const char*>(fresh.untyped_data());
  for (int64_t b = 0; b < B; ++b) {
    const int64_t r = rows.typed_data()[b], p = pos.typed_data()[b];
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k)
        std::memcpy(dst + (((l * R + r) * K + k) * S + p + t) * slot, src + ((b * T + t) * K + k) * slot, slot);
  }
  return ffi::Error::Success();
}

// Zeros [p, p + bytes) touching as little of it as the OS allows: the partial pages at its ends are
// written, the whole pages between are handed back (MADV_DONTNEED: they then read as zeros and are
// backed by memory only once written), and kept off transparent huge pages, which would back a whole
// 2 MB at a row's first write. Where the OS refuses, every byte is written.
void ZeroLazily(char* p, size_t bytes) {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t a = reinterpret_cast<uintptr_t>(p), e = a + bytes;
  const uintptr_t first = (a + page - 1) / page * page, last = e / page * page;
  if (last <= first) {
    std::memset(p, 0, bytes);
    return;
  }
  std::memset(p, 0, first - a);
  std::memset(reinterpret_cast<char*>(last), 0, e - last);
  void* const middle = reinterpret_cast<void*>(first);
#ifdef MADV_NOHUGEPAGE
  madvise(middle, last - first, MADV_NOHUGEPAGE);
#endif
  if (madvise(middle, last - first, MADV_DONTNEED) != 0) std::memset(middle, 0, last - first);
}

ffi::Error Reserve(ffi::Result<ffi::AnyBuffer> out) {
  ZeroLazily(static_cast<char*>(out->untyped_data()), out->size_bytes());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsmolLoadPrefix, LoadPrefix,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsmolWriteSlots, WriteSlots,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Where>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsmolReadSlots, ReadSlots,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Where>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsmolCopyRow, CopyRow,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Where>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsmolWriteRows, WriteRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Where>()
                                  .Arg<Where>()
                                  .Arg<Index>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsmolReserve, Reserve, ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());
