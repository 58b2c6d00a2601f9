// torch.argmax(x, dim=-1) over the rows of a float32 matrix (greedy sampling's logits), with torch's answer
// to the letter: the first index of the largest value, and where a row holds a NaN the first NaN (torch
// ranks NaN above everything). torch's CPU argmax reads the 49,152 logits of a SmolLM2 row one at a time:
// 130 us a row and 1.55 ms for 32 rows on Sapphire Rapids, 3.5% of a bf16 decode step at batch 32. Here
// 16 lanes each keep their largest value and its first index, and the lanes are reduced once at the end.
// At a level below avx512 the op runs torch's own argmax.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_isa.h"

namespace {

// the first NaN of x[0, n), or -1
int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(x[i])) return i;
  return -1;
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) int64_t argmax_row_avx512(const float* x, int64_t n) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i step = _mm512_set1_epi32(16);
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 best = neg_inf;
  __m512i best_idx = idx;
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    // strictly greater: a lane keeps the first index of an equal value
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, gt, v);
    best_idx = _mm512_mask_mov_epi32(best_idx, gt, idx);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    idx = _mm512_add_epi32(idx, step);
  }
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 v = _mm512_mask_loadu_ps(neg_inf, tail, x + i);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, gt, v);
    best_idx = _mm512_mask_mov_epi32(best_idx, gt, idx);
    nan |= _mm512_mask_cmp_ps_mask(tail, v, v, _CMP_UNORD_Q);
  }
  if (nan) return first_nan(x, n);
  // a row of -inf keeps lane 0's index 0, as torch answers; among the lanes holding the largest value the
  // smallest index is the first occurrence
  const __mmask16 top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(_mm512_reduce_max_ps(best)), _CMP_EQ_OQ);
  return _mm512_reduce_min_epi32(_mm512_mask_mov_epi32(_mm512_set1_epi32(INT32_MAX), top, best_idx));
}
#endif

}  // namespace

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0 &&
              x.size(1) <= INT32_MAX, "argmax_rows: [rows, n] float32 with a unit inner stride, 0 < n < 2^31");
#if defined(__x86_64__)
  if (active_kernels().isa >= Isa::kAvx512) {
    const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
    auto out = torch::empty({rows}, x.options().dtype(at::kLong));
    const float* xp = x.data_ptr<float>();
    int64_t* op = out.data_ptr<int64_t>();
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row_avx512(xp + r * ld, n);
    });
    return out;
  }
#endif
  return at::argmax(x, -1);
}

TORCH_LIBRARY_FRAGMENT(baton_cpu, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
}
TORCH_LIBRARY_IMPL(baton_cpu, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
}
