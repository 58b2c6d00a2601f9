// RMSNorm and rotate-half RoPE for the CPU decoder, fp32: one op each where torch runs five to twelve.
//
// At batch 1 a decode step's 61 norms and 30 RoPEs are each a handful of tiny torch ops (pow, mean, add,
// rsqrt, mul / mul, neg, cat, mul, add), dispatch overhead on 576 floats. The arithmetic is
// transformers' (x * rsqrt(mean(x^2) + eps) * w; q * cos + rotate_half(q) * sin); only the order of the
// sum of squares (8 partial sums) and FMA contraction differ from torch's, so results agree to fp32
// rounding, and every row is computed alone: a token gives the same bits in any batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "simd_dot.h"

static inline void norm_row(const float* __restrict xr, const float* __restrict w, float* __restrict o, int64_t d,
                            float eps) {
  const float ss = dot(xr, xr, d);
  const float rstd = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
#pragma omp simd
  for (int64_t j = 0; j < d; ++j) o[j] = (xr[j] * rstd) * w[j];
}

static void check_weight(const torch::Tensor& weight, int64_t d) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == d && weight.is_contiguous() &&
              weight.scalar_type() == at::kFloat, "rms_norm: weight must be [d] float32");
}

// small batches stay on the calling thread: waking the pool costs more than the norm
static int64_t grain(int64_t d) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(d, 1)); }

// [rows, d] (unit inner stride, any row stride) -> contiguous [rows, d]
torch::Tensor rms_norm_rows(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "rms_norm_rows: [rows, d] float32");
  check_weight(weight, x.size(1));
  const int64_t rows = x.size(0), d = x.size(1), ld = x.stride(0);
  auto out = torch::empty({rows, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain(d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * ld, w, op + r * d, d, static_cast<float>(eps));
  });
  return out;
}

// The decoder's residual step, "x = x + delta; h = rms_norm(x)", in one pass: returns (x + delta, h), each
// contiguous [rows, d]. The sum is torch's add (one IEEE addition per element) and h is rms_norm_rows of it,
// so the bits are those of the two ops apart.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm_rows(torch::Tensor x, torch::Tensor delta,
                                                           torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && delta.sizes() == x.sizes() &&
              delta.scalar_type() == at::kFloat && delta.is_contiguous(),
              "add_rms_norm_rows: contiguous [rows, d] float32 x and delta");
  check_weight(weight, x.size(1));
  const int64_t rows = x.size(0), d = x.size(1);
  auto sum = torch::empty({rows, d}, x.options());
  auto out = torch::empty({rows, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* ap = delta.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain(d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* __restrict xr = xp + r * d;
      const float* __restrict ar = ap + r * d;
      float* __restrict sr = sp + r * d;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) sr[j] = xr[j] + ar[j];
      norm_row(sr, w, op + r * d, d, static_cast<float>(eps));
    }
  });
  return {sum, out};
}

// x [n, heads, D] rotated in place at each token's angles; cos / sin [n, D] (both halves, as torch's table)
static void rope_one(torch::Tensor x, const float* cos, const float* sin, int64_t D) {
  const int64_t n = x.size(0), heads = x.size(1), half = D / 2;
  const int64_t ts = x.stride(0), hs = x.stride(1);
  float* xp = x.data_ptr<float>();
  at::parallel_for(0, n, std::max<int64_t>(1, 4096 / std::max<int64_t>(heads * D, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* __restrict c = cos + t * D;
      const float* __restrict s = sin + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        float* __restrict v = xp + t * ts + h * hs;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a * c[i] - b * s[i];
          v[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
    }
  });
}

void rope_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 &&
              q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat, "rope_: [n, heads, D] float32 q, k");
  const int64_t n = q.size(0), D = q.size(2);
  TORCH_CHECK(D % 2 == 0 && k.size(0) == n && k.size(2) == D, "rope_: q and k shapes disagree");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == n && cos.size(1) == D && cos.is_contiguous() &&
              sin.sizes() == cos.sizes() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat, "rope_: cos / sin must be contiguous [n, D] float32");
  rope_one(q, cos.data_ptr<float>(), sin.data_ptr<float>(), D);
  rope_one(k, cos.data_ptr<float>(), sin.data_ptr<float>(), D);
}

TORCH_LIBRARY_FRAGMENT(baton_cpu, m) {
  m.def("rms_norm_rows(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_rows(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
}
TORCH_LIBRARY_IMPL(baton_cpu, CPU, m) {
  m.impl("rms_norm_rows", &rms_norm_rows);
  m.impl("add_rms_norm_rows", &add_rms_norm_rows);
  m.impl("rope_", &rope_);
}
