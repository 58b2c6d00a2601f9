// exp for the attention kernels' softmax (paged_decode_impl.h, prefill_attention_impl.h).
// No `#pragma once`: each kernel's *_impl.h includes it inside each level's namespace (isa_variants.h).
// Needs <cmath>, <cstdint> and <cstring>, which the kernel's .cpp includes first.

// exp(x) for x <= 0 (scores minus their row's max), written so that `omp simd` vectorises it: libm's
// expf stays one scalar call per score (glibc's vector expf needs -ffast-math for the whole file).
// Cephes' expf: x = k ln2 + r with |r| <= ln2 / 2, a degree-7 polynomial for exp(r), 2^k through the
// exponent bits. Relative error about 1e-7, as libm's.
static inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;  // below this 2^k leaves the normal range; exp is < 2e-38 anyway
  const float k = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

