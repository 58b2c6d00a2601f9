// A ymm register's 8 lanes folded into one float, for the avx2 level's kernels (paged_decode_avx2.h, the
// prompt-chunk softmax in prefill_attention_impl.h, W8A8's row quantization in w8a8_impl.h).
// No `#pragma once`: an *_impl.h includes it inside each level's namespace (isa_variants.h).
#if BATON_ISA == BATON_ISA_AVX2
// v's 8 lanes folded by op (_mm_add_ps or _mm_max_ps, in a lambda) in a fixed order: the two halves, then
// lanes 0 + 2 and 1 + 3, then those two. The order is part of each caller's bits.
template <typename Op>
static inline float reduce8(__m256 v, Op op) {
  __m128 s = op(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = op(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(op(s, _mm_movehdup_ps(s)));
}
static inline float reduce_max8(__m256 v) {
  return reduce8(v, [](__m128 a, __m128 b) { return _mm_max_ps(a, b); });
}
static inline float reduce_add8(__m256 v) {
  return reduce8(v, [](__m128 a, __m128 b) { return _mm_add_ps(a, b); });
}
#endif
