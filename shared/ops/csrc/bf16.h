// bf16 <-> fp32 on the bits, as torch's c10::BFloat16 converts (round to nearest even; NaN stays NaN).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

static inline float bf16_bits_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

static inline uint16_t float_to_bf16_bits(float f) {
  if (std::isnan(f)) return 0x7fc0;
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
