// A static split that lends its tail: parallel_steal runs items as at::parallel_for would (each thread one
// contiguous range, front to back), but a thread whose range is done takes the items still left at the back
// of the others' ranges, back to front, until none is left.
//
// Why: a static split waits at its closing barrier for the slowest thread. On the 2-vCPU AVX2 machine (Zen 3)
// the same single-thread W8A8 work timed on one vCPU and then the other ran 0.76x to 1.38x apart, the faster
// one changing from one second to the next (a neighbour's load on the host, not ours), and under served load
// each thread spent 3-6% of its samples in libgomp's barrier wait. Which thread runs an item never changes
// what it computes, so every result stays bit for bit the same.
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
