// 16 cached keys or values widened to fp32 from avx512 up, for the two attention kernels (paged_decode_impl.h,
// prefill_attention_impl.h), and 8 at avx2. No `#pragma once`: an *_impl.h includes it
// inside each level's namespace (isa_variants.h), after fp8.h was included at file scope.
#if BATON_ISA >= BATON_ISA_AVX2
// What load16 and load8 leave an fp8 e4m3 value divided by (below)
template <typename KV>
constexpr float kUnit = std::is_same_v<KV, fp8_e4m3> ? 256.f : 1.f;
#endif

#if BATON_ISA >= BATON_ISA_AVX512
// 16 cached keys or values as fp32, divided by kUnit<KV>: loaded, or widened from bf16 (a shift of each lane's
// bits) or from fp8 (as fp16 bits that vcvtph2ps widens; fp8.h). An e4m3 byte sign-extended to 16 bits and
// shifted left 7 is the fp16 of its value / 256 but for bit 14, the sign again, which the mask clears; the 256
// is taken out of the query and put back into the normaliser by the decode kernel (powers of two: the same
// bits, unless a weighted value falls below fp32's normals), and multiplied back in by widen16. The decode
// kernel is bound by these instructions more than by DRAM (with the cache in L3 it takes ~80% of its time out
// of it), so each counts. 30 layers at batch 32 from DRAM, Zen 5,
// two threads: with the sign masked and shifted in apart and a multiply by 256 here, 7.6-7.8 ms against bf16's
// 8.4-8.6 in the same runs; as here, 7.58 against 9.95 (bench/kv_cache_dtype.py --kernel; e5m2 7.25).
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline __m512 load16(const fp8_e5m2* p) {  // the top byte of an fp16
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p)), 8));
}
static inline __m512 load16(const fp8_e4m3* p) {
  const __m256i h = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p)), 7);
  return _mm512_cvtph_ps(_mm256_and_si256(h, _mm256_set1_epi16((short)0xbfff)));
}
// the values themselves (load16's times kUnit)
template <typename KV>
static inline __m512 widen16(const KV* p) {
  if constexpr (kUnit<KV> == 1.f) return load16(p);
  else return _mm512_mul_ps(load16(p), _mm512_set1_ps(kUnit<KV>));
}
#endif

#if BATON_ISA == BATON_ISA_AVX2
// load16's widenings on 8 values (F16C's vcvtph2ps takes 8 halves): the same bits, e4m3 likewise / kUnit
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline __m256 load8(const fp8_e5m2* p) {
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)p)), 8));
}
static inline __m256 load8(const fp8_e4m3* p) {
  const __m128i h = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)p)), 7);
  return _mm256_cvtph_ps(_mm_and_si128(h, _mm_set1_epi16((short)0xbfff)));
}
// the values themselves (load8's times kUnit), for the prompt-chunk kernel
template <typename KV>
static inline __m256 widen8(const KV* p) {
  if constexpr (kUnit<KV> == 1.f) return load8(p);
  else return _mm256_mul_ps(load8(p), _mm256_set1_ps(kUnit<KV>));
}
#endif
