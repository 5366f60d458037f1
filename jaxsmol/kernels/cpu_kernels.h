// What the two kernel sources share (cpu_matmul.cc, cpu_attention.cc; built into one library by
// cpu_kernels.py): the vector type and XLA's thread pool as a parallel-for.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The vector is the target's own: one zmm register with AVX-512, else one ymm (AVX2; other targets
// split it). A vector wider than the target's registers is emulated, and the register tiles below
// then spill on every step: a 16-lane build ran the matmuls at 4 GFLOP/s on an AVX2-only CPU (Zen 1),
// 1/17 of XLA's dot there. The lane count changes no matmul bits (each output element is one FMA
// chain over k) and no prompt row's attention bits (a row is one lane, summed in position order);
// it does change the order of a decode step's q.k sums (LaneSum), so it is part of the engine's
// fingerprint (JaxsmolVectorLanes, cpu_kernels.vector_lanes).
#if defined(__AVX512F__)
constexpr int kLanes = 16;    // floats per vector
constexpr int kVecRegs = 32;  // vector registers
#else
constexpr int kLanes = 8;
constexpr int kVecRegs = 16;
#endif

typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

inline Vec Load(const float* p) { Vec v; std::memcpy(&v, p, sizeof v); return v; }
inline void Store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }

// A weight vector as float32: stored float32, or bfloat16 (a float32's upper 16 bits, so widening
// is exact: the bits shifted up). A product then sums the same float32 values in the same order
// whichever way its weights are stored; bfloat16 halves the bytes a decode step streams.
typedef uint16_t HalfVec __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t WideVec __attribute__((vector_size(kLanes * sizeof(uint32_t))));
inline Vec LoadWeight(const float* p) { return Load(p); }
inline Vec LoadWeight(const uint16_t* p) {
  HalfVec h;
  std::memcpy(&h, p, sizeof h);
  const WideVec wide = __builtin_convertvector(h, WideVec) << 16;
  Vec v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

// At least n floats of scratch for one use site (Site) on this thread, kept between calls: a fresh
// buffer of more than 128 KB is a new mapping in glibc, faulted in page by page on every call (a
// 1024-token prefill: +133K page faults when attention allocated its scratch per task). Pool threads
// may read the caller's buffer, but only during the call that filled it.
template <int Site>
float* ThreadScratch(size_t n) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

// Runs fn(i) for i in [0, n) on the calling thread and XLA's intra-op pool. Tasks take indices from
// a shared counter, so the caller never waits on a task that has not started, only on indices
// another thread is computing (no deadlock when every pool thread is busy).
template <typename Fn>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, Fn fn) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  auto work = [state, n, fn] {
    for (int64_t i; (i = state->next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      fn(i);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), n) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule(decltype(work)(work));  // each task its own copy
  work();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

// Runs fn(i0, i1, more) over [0, n) in runs of up to `run` indices, on the calling thread and the pool
// (as ParallelFor's tasks): task t of T claims runs in order from its share [n t / T, n (t + 1) / T),
// then from the shares after it; `more`: the share goes on at i1 (this thread likely claims it next,
// so it may fetch it ahead). A thread whose core is taken away for a while (a VM's vCPU descheduled)
// then holds up one run, not the rest of its share: an 8-row decode step on a 2-vCPU VM (AVX2 build,
// Q8_0) took 17.9-18.6 ms on average against 22.4-23.9 with one share a thread, alternated step by
// step in one process (p90 19.0-20.8 against 29.2-31.5 ms).
template <typename Fn>
void ParallelForShares(ffi::ThreadPool& pool, int64_t n, int64_t run, Fn fn) {
  struct alignas(64) Share {
    std::atomic<int64_t> next;
    int64_t end;
  };
  const int64_t T = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), n);
  if (T <= 0) return;
  std::unique_ptr<Share[]> shares(new Share[T]);
  for (int64_t t = 0; t < T; ++t) {
    shares[t].next.store(n * t / T, std::memory_order_relaxed);
    shares[t].end = n * (t + 1) / T;
  }
  Share* const all = shares.get();  // outlives every task: ParallelFor returns when all are done
  ParallelFor(pool, T, [all, T, run, fn](int64_t t) {
    for (int64_t s = 0; s < T; ++s) {
      Share& share = all[(t + s) % T];
      for (int64_t i; (i = share.next.fetch_add(run, std::memory_order_relaxed)) < share.end;) {
        const int64_t end = std::min(i + run, share.end);
        fn(i, end, end < share.end);
      }
    }
  });
}

// The layer a call reads: a scalar operand, so that one compiled loop body serves every layer and
// the kernels read that layer's weights and cache in place (a traced slice would be copied first).
using LayerIndex = ffi::Buffer<ffi::S32, 0>;

// The layer index, or -1 where it lies outside 0..L-1.
inline int64_t LayerOf(const LayerIndex& layer, int64_t L) {
  const int64_t l = *layer.typed_data();
  return l >= 0 && l < L ? l : -1;
}

}  // namespace
