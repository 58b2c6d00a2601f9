// The dot product both CPU kernels use (paged_decode_cpu.cpp: q . k; norm_rope_cpu.cpp: x . x for RMSNorm).
//
// Partial sums the compiler maps onto a vector register (8 floats: one AVX2 register; SSE and NEON builds
// split it in two). Written as plain loops over a fixed-size array, not intrinsics, so any target builds.
// A single running float sum cannot be vectorised: its order is fixed.
// No `#pragma once`: a kernel's *_impl.h includes it inside each level's namespace (isa_variants.h), and its
// .cpp must have included bf16.h and fp8.h at file scope first (their `#pragma once` then skips them here).

#include <cstdint>

#include "bf16.h"
#include "fp8.h"

constexpr int kLanes = 8;

static inline float to_f32(float v) { return v; }
static inline float to_f32(uint16_t bf16_bits) { return bf16_bits_to_float(bf16_bits); }
static inline float to_f32(fp8_e4m3 v) { return fp8_to_float(v); }
static inline float to_f32(fp8_e5m2 v) { return fp8_to_float(v); }

// b: fp32, or bf16 bits or fp8 (a bf16 or fp8 KV cache's keys), widened as they are read
template <typename T>
static inline float dot(const float* __restrict a, const T* __restrict b, int64_t D) {
  float lanes[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += a[d + l] * to_f32(b[d + l]);
  float s = 0.f;
  for (; d < D; ++d) s += a[d] * to_f32(b[d]);
  for (int l = 0; l < kLanes; ++l) s += lanes[l];
  return s;
}
