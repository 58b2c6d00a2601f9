// The vdpbf16ps passes of the two attention kernels (paged_decode_impl.h, prefill_attention_impl.h), from
// avx512_bf16 up, for a bf16 or fp8 cache. No `#pragma once`: an *_impl.h includes it inside each level's
// namespace (isa_variants.h), after fp8.h was included at file scope.
//
// An fp8 byte becomes a bf16 by a shift of its bits (three instructions per 32 values, where widening to fp32
// takes four per 16): e4m3 sign-extended to 16 bits, shifted left 4 and masked is the bf16 of its value *
// 2^-120, e5m2 shifted 5 of its value * 2^-112 (a bf16 cache is read as it is). The queries and the softmax
// weights are rounded to bf16 scaled by 2^(shift - 20), so that the products land at 2^-20 of their value,
// well inside fp32's normals; the sums are fp32. vdpbf16ps reads subnormal inputs as zero: fp8 values below
// the format's smallest normal (2^-6 for e4m3, 2^-14 for e5m2) count as zero, an error below the format's
// own rounding of any value above 2^-2.
#if BATON_ISA >= BATON_ISA_AVX512_BF16
template <typename KV>
constexpr int kBf16Shift = std::is_same_v<KV, fp8_e4m3> ? 120 : std::is_same_v<KV, fp8_e5m2> ? 112 : 0;
template <typename KV>  // the query and the weights are scaled by 2^this before rounding to bf16
constexpr int kOperandExp = kBf16Shift<KV> == 0 ? 0 : kBf16Shift<KV> - 20;
template <typename KV>  // what a sum of products is multiplied by to be the sum of the values' products
constexpr float kProductUnit = static_cast<float>(1u << (kBf16Shift<KV> - kOperandExp<KV>));

// 32 cached values (dims 32i .. 32i + 31 of one head) as bf16 of value * 2^-kBf16Shift, element i = dim i
static inline __m512i load32_bf16(const uint16_t* p) { return _mm512_loadu_si512(p); }
static inline __m512i load32_bf16(const fp8_e4m3* p) {
  const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p));
  return _mm512_and_si512(_mm512_slli_epi16(w, 4), _mm512_set1_epi16((short)0x87f0));
}
static inline __m512i load32_bf16(const fp8_e5m2* p) {
  const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p));
  return _mm512_and_si512(_mm512_slli_epi16(w, 5), _mm512_set1_epi16((short)0x8fe0));
}

// n fp32 values * scale as bf16 (to nearest even), out padded with zeros to a multiple of 32
static inline void to_bf16_scaled(const float* x, int64_t n, float scale, uint16_t* out) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < n; i += 32) {
    const __mmask16 m0 = (__mmask16)(n - i >= 16 ? 0xffff : (1u << (n - i)) - 1);
    const __mmask16 m1 = (__mmask16)(n - i >= 32 ? 0xffff : n - i <= 16 ? 0 : (1u << (n - i - 16)) - 1);
    const __m512 lo = _mm512_mul_ps(_mm512_maskz_loadu_ps(m0, x + i), s);
    const __m512 hi = _mm512_mul_ps(_mm512_maskz_loadu_ps(m1, x + i + 16), s);
    _mm512_storeu_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// Values as pairs of two tokens' (unpacklo / unpackhi of their bf16 vectors, per 128-bit lane) leave each 32
// dims' sums in two registers: the first holds dims 0-3, 8-11, 16-19, 24-27, the second 4-7, 12-15, 20-23,
// 28-31. This puts count32 such pairs of registers, stored in turn, back in the dims' order.
static inline void unpermute_pairs(float* acc, int64_t count32) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t i = 0; i < count32; ++i) {
    const __m512 lo = _mm512_loadu_ps(acc + i * 32), hi = _mm512_loadu_ps(acc + i * 32 + 16);
    _mm512_storeu_ps(acc + i * 32, _mm512_permutex2var_ps(lo, first, hi));
    _mm512_storeu_ps(acc + i * 32 + 16, _mm512_permutex2var_ps(lo, second, hi));
  }
}
#endif
