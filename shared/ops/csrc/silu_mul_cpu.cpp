// silu(gate) * up for the CPU decoder's MLP, fp32: one op and one pass where torch runs silu, then mul, over
// a strided half of the gate_up projection's output (two ops, two passes and a temporary).
//
// It must change no bit: torch's result is the reference, and the batch must give what the model always gave.
// So silu is computed as torch's CPU kernel computes it (aten/src/ATen/native/cpu/Activation.cpp), vector
// for vector: x / (1 + exp(-x)) with exp from SLEEF (Sleef_expf16_u10 on AVX-512, Sleef_expf8_u10 on AVX2,
// the symbols libtorch_cpu exports), over chunks of two vectors, and the leftover elements of a row with
// libm's expf, as torch's vectorized loop leaves them to its scalar form. Whether the bits agree on this
// machine is checked when a model is loaded (shared/ops/silu_mul_cpu.py), which otherwise keeps torch's ops.
// The form follows torch's own CPU capability (its DispatchStub's choice), not the kernels' level: the
// AVX-512 and AVX2 forms are compiled in `#pragma GCC target` regions (silu_mul_impl.h) and picked at run time.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <ATen/Version.h>

#include <string>

#include "kernels_cpu.h"

namespace silu_scalar {
constexpr int64_t kVec = 0;
static inline void silu_mul_vec(const float*, const float*, float*) {}
#include "silu_mul_impl.h"
}  // namespace silu_scalar

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
// libtorch_cpu's SLEEF (sleef.h declares the vector forms only when the whole file is compiled for them)
extern "C" __m256 Sleef_expf8_u10(__m256);
namespace silu_avx2 {
constexpr int64_t kVec = 8;
static inline void silu_mul_vec(const float* g, const float* u, float* o) {
  const __m256 x = _mm256_loadu_ps(g);
  const __m256 e = Sleef_expf8_u10(_mm256_xor_ps(_mm256_set1_ps(-0.f), x));
  const __m256 s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e));
  _mm256_storeu_ps(o, _mm256_mul_ps(s, _mm256_loadu_ps(u)));
}
#include "silu_mul_impl.h"
}  // namespace silu_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
extern "C" __m512 Sleef_expf16_u10(__m512);
namespace silu_avx512 {
constexpr int64_t kVec = 16;
static inline void silu_mul_vec(const float* g, const float* u, float* o) {
  const __m512 x = _mm512_loadu_ps(g);
  const __m512 e = Sleef_expf16_u10(_mm512_xor_ps(_mm512_set1_ps(-0.f), x));  // torch's neg()
  const __m512 s = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  _mm512_storeu_ps(o, _mm512_mul_ps(s, _mm512_loadu_ps(u)));
}
#include "silu_mul_impl.h"
}  // namespace silu_avx512
#pragma GCC pop_options
#endif

using SiluRowsFn = void (*)(const float*, int64_t, float*, int64_t, int64_t, int64_t);

// the vector width of the form torch's own silu runs on this CPU (0: scalar)
static int64_t torchs_vec() {
#if defined(__x86_64__)
  const std::string capability = at::get_cpu_capability();  // "AVX512", "AVX2", "DEFAULT", ...
  if (capability == "AVX512") return silu_avx512::kVec;
  if (capability == "AVX2") return silu_avx2::kVec;
#endif
  return 0;
}

static SiluRowsFn torchs_form() {
#if defined(__x86_64__)
  if (torchs_vec() == silu_avx512::kVec) return &silu_avx512::silu_rows;
  if (torchs_vec() == silu_avx2::kVec) return &silu_avx2::silu_rows;
#endif
  return &silu_scalar::silu_rows;
}

SiluColsFn silu_mul_cols() {
  static const SiluColsFn fn = [] {
#if defined(__x86_64__)
    if (torchs_vec() == silu_avx512::kVec) return &silu_avx512::silu_cols;
    if (torchs_vec() == silu_avx2::kVec) return &silu_avx2::silu_cols;
#endif
    return &silu_scalar::silu_cols;
  }();
  return fn;
}

// gate_up [rows, 2 * I] (unit inner stride, any row stride): gate is the first half of each row, up the second
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat && gate_up.stride(1) == 1 &&
              gate_up.size(1) % 2 == 0, "silu_mul: [rows, 2 * I] float32 with a unit inner stride");
  static const SiluRowsFn rows_fn = torchs_form();
  const int64_t rows = gate_up.size(0), I = gate_up.size(1) / 2, ld = gate_up.stride(0);
  auto out = torch::empty({rows, I}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // rows split across the threads from about 8k outputs (6 rows of SmolLM2's): at 16 rows 9 against 12 us
  // on one thread
  at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / std::max<int64_t>(I, 1)), [&](int64_t r0, int64_t r1) {
    rows_fn(in, ld, op, I, r0, r1);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(baton_cpu, m) {
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}
TORCH_LIBRARY_IMPL(baton_cpu, CPU, m) {
  m.impl("silu_mul", &silu_mul);
}
