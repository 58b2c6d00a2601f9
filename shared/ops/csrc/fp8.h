// An fp8 KV cache's bytes (shared/kv/cache_dtype.py): e4m3 (torch.float8_e4m3fn, no infinities, 448 the
// largest) and e5m2 (torch.float8_e5m2), with no scale.
//
// Stored: fp32 rounded to nearest even, as torch's .to(float8) rounds, after clamping to the largest finite
// value (what shared/kv/cache_dtype.to_cache_dtype does), so the kernels and the torch reference store the
// same bits. Read: exactly, every fp8 value being an fp32 one: through a table in the portable loops, and
// from AVX-512 up (paged_decode_impl.h's load16) as an fp16 vector that vcvtph2ps widens: e5m2 is the top
// byte of an fp16, e4m3 an fp16 whose exponent is 8 short (its bias 7 against 15), a value / 256.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

struct fp8_e4m3 {
  uint8_t bits;
};
struct fp8_e5m2 {
  uint8_t bits;
};

// The format's mantissa bits, exponent bias and largest finite value
template <typename F>
struct Fp8Format;
template <>
struct Fp8Format<fp8_e4m3> {
  static constexpr int kMant = 3, kBias = 7;
  static constexpr float kMax = 448.f;
  static constexpr uint8_t kNaN = 0x7f;
};
template <>
struct Fp8Format<fp8_e5m2> {
  static constexpr int kMant = 2, kBias = 15;
  static constexpr float kMax = 57344.f;
  static constexpr uint8_t kNaN = 0x7f;
};

// The bits of f in format F: saturated to +-kMax, rounded to nearest even, NaN kept. Branch-free, selects by
// masks, so that a loop of it vectorises (with ?: gcc left a branch and the loop scalar).
template <typename F>
static inline uint8_t float_to_fp8_bits(float f) {
  using Fmt = Fp8Format<F>;
  constexpr int M = Fmt::kMant;
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t sign = (u >> 24) & 0x80u;
  // |f| clamped to kMax on the bits (ordered as the values are; NaN's are above kMax's and put back below)
  uint32_t max_bits;
  constexpr float kMax = Fmt::kMax;
  std::memcpy(&max_bits, &kMax, sizeof(max_bits));
  const uint32_t au = std::min(u & 0x7fffffffu, max_bits);
  float a;
  std::memcpy(&a, &au, sizeof(a));
  // normal: drop 23 - M mantissa bits, rounding to nearest even, and re-bias the exponent
  const uint32_t normal = ((au + ((1u << (22 - M)) - 1) + ((au >> (23 - M)) & 1u)) >> (23 - M)) -
                          (static_cast<uint32_t>(127 - Fmt::kBias) << M);
  // below the smallest normal, 2^(1 - bias): the multiple of the smallest subnormal, 2^(1 - bias - M), that
  // is nearest (even on a tie): adding 2^23 leaves a unit in the last place of 1, so the add rounds
  constexpr float kSubnormalsPerUnit = static_cast<float>(1u << (Fmt::kBias - 1 + M));  // 2^(bias - 1 + M)
  constexpr float kMinNormal = 1.f / static_cast<float>(1u << (Fmt::kBias - 1));        // 2^(1 - bias)
  const float scaled = a * kSubnormalsPerUnit + 8388608.f;
  uint32_t su;
  std::memcpy(&su, &scaled, sizeof(su));
  const uint32_t sub = su - 0x4b000000u;
  const uint32_t is_sub = 0u - static_cast<uint32_t>(a < kMinNormal);  // all ones or none: a select, no branch
  const uint32_t is_nan = 0u - static_cast<uint32_t>(f != f);
  const uint32_t code = (normal & ~is_sub) | (sub & is_sub);
  return static_cast<uint8_t>(sign | (code & ~is_nan) | (Fmt::kNaN & is_nan));
}

template <typename F>
static inline float fp8_bits_to_float_exact(uint8_t b) {
  using Fmt = Fp8Format<F>;
  constexpr int M = Fmt::kMant;
  const int e = (b & 0x7f) >> M, m = b & ((1 << M) - 1);
  float v = e == 0 ? std::ldexp(static_cast<float>(m), 1 - Fmt::kBias - M)
                   : std::ldexp(static_cast<float>((1 << M) + m), e - Fmt::kBias - M);
  // e5m2's top exponent holds inf (mantissa 0) and NaN; e4m3's 0x7f is its only NaN
  if (e == (0x7f >> M) && (M == 2 || m == 7)) v = (M == 2 && m == 0) ? INFINITY : NAN;
  return (b & 0x80) ? -v : v;
}

template <typename F>
inline const std::array<float, 256> kFp8ToFloat = [] {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) t[b] = fp8_bits_to_float_exact<F>(static_cast<uint8_t>(b));
  return t;
}();

static inline float fp8_to_float(fp8_e4m3 v) { return kFp8ToFloat<fp8_e4m3>[v.bits]; }
static inline float fp8_to_float(fp8_e5m2 v) { return kFp8ToFloat<fp8_e5m2>[v.bits]; }

// n fp32 values stored as format F's bits
template <typename F>
static inline void store_fp8(uint8_t* __restrict dst, const float* __restrict src, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_fp8_bits<F>(src[i]);
}
