// The dot product both CPU kernels use (paged_decode_cpu.cpp: q . k; norm_rope_cpu.cpp: x . x for RMSNorm).
//
// Partial sums the compiler maps onto a vector register (8 floats: one AVX2 register; SSE and NEON builds
// split it in two). Written as plain loops over a fixed-size array, not intrinsics, so any target builds.
// A single running float sum cannot be vectorised: its order is fixed.
#pragma once

#include <cstdint>

constexpr int kLanes = 8;

static inline float dot(const float* __restrict a, const float* __restrict b, int64_t D) {
  float lanes[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += a[d + l] * b[d + l];
  float s = 0.f;
  for (; d < D; ++d) s += a[d] * b[d];
  for (int l = 0; l < kLanes; ++l) s += lanes[l];
  return s;
}
