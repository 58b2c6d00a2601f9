// exp for the attention kernels' softmax (paged_decode_impl.h, prefill_attention_impl.h): one float, 8 lanes
// at avx2, or 16 lanes from avx512 up.
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

#if BATON_ISA >= BATON_ISA_AVX512
// exp_nonpositive's steps on 16 lanes (the prefill kernel's softmax, a tile's scores in one register)
static inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 k = _mm512_floor_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)));
  const __m512 r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

#if BATON_ISA == BATON_ISA_AVX2
// exp_nonpositive's steps on 8 lanes (both kernels' softmax at avx2)
static inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 k = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  const __m256 r = _mm256_fmadd_ps(k, _mm256_set1_ps(2.12194440e-4f),
                                   _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif
