// Causal attention of one prompt chunk on the CPU: fp32 queries [Lq, H, D], the chunk's context keys and
// values [Lk, Hkv, D] (fp32, or bf16 or fp8 widened as they are read), Lk >= Lq: query i sits at position
// Lk - Lq + i and sees the keys at positions <= its own (and, with a window w > 0, > its own - w). Query head
// h reads KV head h / (H / Hkv) (transformers' repeat_kv order). out [Lq, H, D] fp32.
//
// Why: torch's SDPA on the CPU ran a 256-token chunk of SmolLM2 (9 heads, 3 KV heads, head dim 64) at
// ~1.2 ms a layer with a mask or with is_causal, a fifth of a 2048-token prefill step: its flash kernel
// splits keys in blocks of hundreds, so a chunk that short skips no masked work. Here a job is 32 query
// positions of every query head of one KV head: each tile of 32 keys is widened and transposed once for all
// of them, scores and the online softmax run per row, and tiles past a row's position are skipped, so the
// masked half of the triangle costs nothing.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "fp8.h"
#include "cpu_isa.h"

// Whether a bf16 or fp8 cache goes through the vdpbf16ps passes where the level has them (avx512_bf16 and up),
// else the fp32 ones (as paged_decode_bf16 for the decode kernel)
static std::atomic<bool> prefill_bf16{true};

bool prefill_attention_bf16(bool on) { return prefill_bf16.exchange(on); }

#define BATON_IMPL "prefill_attention_impl.h"
#include "isa_variants.h"

void prefill_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key, torch::Tensor value,
                       double scale, int64_t window) {
  const auto kv = key.scalar_type();
  TORCH_CHECK(query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && value.scalar_type() == kv &&
              (kv == at::kFloat || kv == at::kBFloat16 || kv == at::kFloat8_e4m3fn || kv == at::kFloat8_e5m2),
              "prefill_attention: float32 queries and output, float32, bfloat16 or float8 keys and values");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.sizes() == key.sizes() && out.sizes() == query.sizes(),
              "prefill_attention: query / out [Lq, H, D], key / value [Lk, Hkv, D]");
  TORCH_CHECK(query.size(2) == key.size(2) && key.size(1) > 0 && query.size(1) % key.size(1) == 0 &&
              key.size(0) >= query.size(0), "prefill_attention: head dims, head groups or lengths do not match");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1 && out.stride(2) == 1,
              "prefill_attention: the head dim must be contiguous");
  TORCH_CHECK(window >= 0, "prefill_attention: window >= 0 (0: none)");
  if (query.size(0) == 0) return;
  active_kernels().prefill_attention(std::move(out), std::move(query), std::move(key), std::move(value), scale,
                                     window);
}

TORCH_LIBRARY_FRAGMENT(baton_cpu, m) {
  m.def("prefill_attention_bf16(bool on) -> bool", &prefill_attention_bf16);
  m.def("prefill_attention(Tensor(a!) out, Tensor query, Tensor key, Tensor value, float scale, int window) -> ()");
}
TORCH_LIBRARY_IMPL(baton_cpu, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
