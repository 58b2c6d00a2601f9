// A static split that lends its tail: parallel_steal runs items as at::parallel_for would (each thread one
// contiguous range, front to back), but a thread whose range is done takes the items still left at the back
// of the others' ranges, back to front, until none is left.
//
// Why: a static split waits at its closing barrier for the slowest thread, and on a shared 2-vCPU machine
// (AVX2, Zen 3) the threads do not keep pace: under served load (32 streams, int8) each spent 3-6% of its
// samples in libgomp's barrier wait, and the same single-thread W8A8 work timed on one vCPU and then on the
// other came out 0.76x to 1.38x apart. Taking made whole prefills of 256 tokens 1.11-1.27x and decode steps
// 1.00-1.17x faster on that machine (bench/work_stealing.py, off and on in turn in one process). Which thread
// runs an item never changes what it computes, so every result stays bit for bit the same.
//
// Used by the projection kernels (w8a8_impl.h, gemv_bf16_impl.h below amx, qgemv_impl.h, gemv_impl.h) and the
// paged decode kernel; the prompt-chunk attention already takes its jobs from a shared counter.
//
// Included by a kernel file before isa_variants.h (it has no instructions of its own; the lambdas it runs are
// compiled at their level). Needs <algorithm> and <cstdint>, which the kernel's .cpp includes first.
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <memory>

// Whether a thread takes from the others at all; on by default. Off, parallel_steal is the static split (each
// range run by its owner only): bench/work_stealing.py turns it off and on in turn through the op
// work_stealing (cpu_isa.cpp) to compare in one process.
inline std::atomic<bool> steal_on{true};

// Ranges of items, one a thread: the unrun part of each, [front, back), in one word so that the owner (from
// the front) and a taker (from the back) never both get an item
struct alignas(64) StealRange {
  std::atomic<uint64_t> span{0};  // front in the low 32 bits, back in the high 32

  static uint64_t pack(uint64_t front, uint64_t back) { return front | back << 32; }

  // The next item from the front (owner) or the back (taker); -1 when the range is empty
  int64_t take(bool from_back) {
    uint64_t s = span.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t front = s & 0xffffffffu, back = s >> 32;
      if (front >= back) return -1;
      const uint64_t next = from_back ? pack(front, back - 1) : pack(front + 1, back);
      if (span.compare_exchange_weak(s, next, std::memory_order_relaxed))
        return static_cast<int64_t>(from_back ? back - 1 : front);
    }
  }
};

// fn(owner, k, taken) for item k of each owner's range, owner in [0, ranges), k in [0, len(owner)), each once:
// `taken` when a thread other than the owner runs it. With one range, or inside another parallel region, it
// is a plain loop. Returns when every item has run (at::parallel_for's own barrier). fn may use
// at::get_thread_num() to pick the calling thread's scratch.
template <typename Len, typename Fn>
inline void parallel_steal(int64_t ranges, const Len& len, const Fn& fn) {
  if (ranges <= 1 || at::in_parallel_region()) {
    for (int64_t t = 0; t < ranges; ++t)
      for (int64_t k = 0, n = len(t); k < n; ++k) fn(t, k, false);
    return;
  }
  const std::unique_ptr<StealRange[]> left(new StealRange[ranges]);
  for (int64_t t = 0; t < ranges; ++t) left[t].span.store(StealRange::pack(0, static_cast<uint64_t>(len(t))));
  const bool steal = steal_on.load(std::memory_order_relaxed);
  at::parallel_for(0, ranges, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t k; (k = left[t].take(false)) >= 0;) fn(t, k, false);
      for (int64_t o = 1; steal && o < ranges; ++o) {  // then the others', the next range first
        const int64_t owner = (t + o) % ranges;
        for (int64_t k; (k = left[owner].take(true)) >= 0;) fn(owner, k, true);
      }
    }
  });
}

// Steps [0, steps) in at most one range a thread of at least `grain` steps (as at::parallel_for(0, steps, grain)
// would give them out), a thread running its range once for each of `blocks` blocks (W8A8's row blocks) in
// turn, each (block, step) once through parallel_steal: fn(block, p, after), `after` the step the calling
// thread runs next as far as it can tell (p + 1 in its own range, p - 1 once it takes from the back of
// another's), -1 at a range's end. The projection kernels prefetch `after`'s panel while they compute p's.
template <typename Fn>
inline void parallel_steal_blocks(int64_t steps, int64_t grain, int64_t blocks, const Fn& fn) {
  const int64_t ranges = std::min<int64_t>(at::get_num_threads(), (steps + grain - 1) / grain);
  auto first = [&](int64_t t) { return steps * t / ranges; };  // ranges <= steps: every range has a step
  parallel_steal(ranges, [&](int64_t t) { return blocks * (first(t + 1) - first(t)); },
                 [&](int64_t t, int64_t k, bool taken) {
    const int64_t begin = first(t), end = first(t + 1), p = begin + k % (end - begin);
    fn(k / (end - begin), p, taken ? (p > begin ? p - 1 : -1) : (p + 1 < end ? p + 1 : -1));
  });
}

// parallel_steal_blocks with one block: fn(p, after)
template <typename Fn>
inline void parallel_steal_steps(int64_t steps, int64_t grain, const Fn& fn) {
  parallel_steal_blocks(steps, grain, 1, [&](int64_t, int64_t p, int64_t after) { fn(p, after); });
}
