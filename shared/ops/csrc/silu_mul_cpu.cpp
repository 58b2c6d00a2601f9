// silu(gate) * up for the CPU decoder's MLP, fp32: one op and one pass where torch runs silu, then mul, over
// a strided half of the gate_up projection's output (two ops, two passes and a temporary).
//
// It must change no bit: torch's result is the reference, and the batch must give what the model always gave.
// So silu is computed as torch's CPU kernel computes it (aten/src/ATen/native/cpu/Activation.cpp), vector
// for vector: x / (1 + exp(-x)) with exp from SLEEF (Sleef_expf16_u10 on AVX-512, Sleef_expf8_u10 on AVX2,
// the symbols libtorch_cpu exports), over chunks of two vectors, and the leftover elements of a row with
// libm's expf, as torch's vectorized loop leaves them to its scalar form. Whether the bits agree on this
// machine is checked when a model is loaded (shared/ops/silu_mul_cpu.py), which otherwise keeps torch's ops.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#include <sleef.h>
#endif

#if defined(__AVX512F__)
constexpr int64_t kVec = 16;
static inline void silu_mul_vec(const float* g, const float* u, float* o) {
  const __m512 x = _mm512_loadu_ps(g);
  const __m512 e = Sleef_expf16_u10(_mm512_xor_ps(_mm512_set1_ps(-0.f), x));  // torch's neg()
  const __m512 s = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  _mm512_storeu_ps(o, _mm512_mul_ps(s, _mm512_loadu_ps(u)));
}
#elif defined(__AVX2__)
constexpr int64_t kVec = 8;
static inline void silu_mul_vec(const float* g, const float* u, float* o) {
  const __m256 x = _mm256_loadu_ps(g);
  const __m256 e = Sleef_expf8_u10(_mm256_xor_ps(_mm256_set1_ps(-0.f), x));
  const __m256 s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e));
  _mm256_storeu_ps(o, _mm256_mul_ps(s, _mm256_loadu_ps(u)));
}
#else
constexpr int64_t kVec = 0;  // torch's default build computes every element the scalar way
static inline void silu_mul_vec(const float*, const float*, float*) {}
#endif

// gate_up [rows, 2 * I] (unit inner stride, any row stride): gate is the first half of each row, up the second
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat && gate_up.stride(1) == 1 &&
              gate_up.size(1) % 2 == 0, "silu_mul: [rows, 2 * I] float32 with a unit inner stride");
  const int64_t rows = gate_up.size(0), I = gate_up.size(1) / 2, ld = gate_up.stride(0);
  auto out = torch::empty({rows, I}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // rows split across the threads from about 8k outputs (6 rows of SmolLM2's): at 16 rows 9 against 12 us
  // on one thread
  at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / std::max<int64_t>(I, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = in + r * ld;
      const float* u = g + I;
      float* o = op + r * I;
      int64_t j = 0;
      if constexpr (kVec > 0) {
        for (; j + 2 * kVec <= I; j += 2 * kVec) {
          silu_mul_vec(g + j, u + j, o + j);
          silu_mul_vec(g + j + kVec, u + j + kVec, o + j + kVec);
        }
      }
      for (; j < I; ++j) o[j] = (g[j] / (1.f + std::exp(-g[j]))) * u[j];
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(baton_cpu, m) {
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}
TORCH_LIBRARY_IMPL(baton_cpu, CPU, m) {
  m.impl("silu_mul", &silu_mul);
}
