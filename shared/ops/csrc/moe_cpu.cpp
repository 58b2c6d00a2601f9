// Gemma 4's routed experts on the CPU in one op: the (token, expert) pairs grouped by expert, each expert's
// two projections through the GEMV kernels on its packed weights, gelu-tanh(gate) * up for all pairs at once,
// and each token's weighted outputs summed back in expert order (as transformers' loop adds them).
//
//   pairs p = (t, j), sorted by e = index[t, j] (counting sort, tokens in order within an expert)
//   x[p]  = h[t]                                          [P, H]   one gather
//   gu[p] = gate_up[e] @ x[p]     one GEMV call per expert hit, its rows contiguous          [P, 2I]
//   a[p]  = gelu_tanh(gu[p, :I]) * gu[p, I:]              [P, I]   one op over every pair
//   y[p]  = down[e] @ a[p]        one GEMV call per expert hit                               [P, H]
//   out[t] = sum over t's pairs, ascending e, of weights[t, j] * y[p]
//
// The weights are packed per expert by the GEMV kernels' own pack ops (gemv_pack for fp32, gemv_bf16_pack
// for bf16, w8a8_pack for int8 per channel, qgemv_pack for 4-bit blocks; shared/models/gemma4/moe_cpu.py), so
// a decode step streams each expert it hits once at DRAM speed, in half the bytes for bf16, about a quarter
// for int8 and a sixth for 4-bit. torch's F.linear (MKL) on these small row counts streamed one layer of
// gemma-4-26B-A4B's experts at ~10 GB/s here (bench/engine.py's MoE config). Experts are split across the
// threads (each reads its own weights), and the kernels' own panel loop runs inside each thread.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_isa.h"
#include "gemv_layout.h"
#include "kernels_cpu.h"

namespace {

// (token, slot) pairs grouped by expert: pair_order[i] is the flat pair index (t * top_k + j) of the i-th
// pair in expert order; starts[e] .. starts[e + 1] are expert e's
struct ExpertGroups {
  std::vector<int64_t> pair_order;
  std::vector<int64_t> starts;
};

ExpertGroups group_by_expert(const torch::Tensor& index, int64_t num_experts) {
  const int64_t P = index.numel();
  const int64_t* ix = index.data_ptr<int64_t>();
  ExpertGroups g{std::vector<int64_t>(P), std::vector<int64_t>(num_experts + 1, 0)};
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(ix[p] >= 0 && ix[p] < num_experts, "moe_experts: expert index ", ix[p], " outside 0..",
                num_experts - 1);
    ++g.starts[ix[p] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) g.starts[e + 1] += g.starts[e];
  std::vector<int64_t> fill(g.starts.begin(), g.starts.end() - 1);
  for (int64_t p = 0; p < P; ++p) g.pair_order[fill[ix[p]]++] = p;  // stable: pairs in token order
  return g;
}

// rows [c, K] fp32 through expert e's packed weight -> [c, N]
torch::Tensor project(const torch::Tensor& rows, const torch::Tensor& packed, int64_t N) {
  const KernelTable& k = active_kernels();
  if (packed.scalar_type() == at::kChar) return w8a8(rows, packed, N);  // W8A8 panels of int8 per channel
  if (packed.scalar_type() == at::kByte) return qgemv(rows, packed, N);  // block formats (qgemv_layout.h)
  if (packed.scalar_type() == at::kBFloat16) return k.gemv_bf16(rows, packed, N, nullptr);
  return k.gemv_f32(rows, packed, N, rows.size(1));  // one FMA chain per output over all of k
}

// out rows [c, N] of expert e for the pairs starts[e] .. starts[e + 1] of `x`, every expert hit, experts
// split across the threads
void project_groups(const torch::Tensor& x, const torch::Tensor& packed, int64_t N, const std::vector<int64_t>& hit,
                    const std::vector<int64_t>& starts, const torch::Tensor& out) {
  at::parallel_for(0, static_cast<int64_t>(hit.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = hit[i], s = starts[e], c = starts[e + 1] - s;
      // a raw copy, not copy_: the worker threads do not inherit the caller's InferenceMode, and `out` may
      // be an inference tensor, which torch refuses to update in place outside it
      const torch::Tensor y = project(x.narrow(0, s, c), packed[e], N);
      std::memcpy(out.data_ptr<float>() + s * N, y.data_ptr<float>(), c * N * sizeof(float));
    }
  });
}

}  // namespace

// h [n, H] fp32; weights [n, top_k] fp32; index [n, top_k] int64; gate_up [E, ...] and down [E, ...] packed per
// expert for outputs 2 * intermediate and H (both fp32, both bf16, both int8 W8A8 panels or both qgemv block
// panels; quantized ones with H and intermediate multiples of 32) -> [n, H] fp32
torch::Tensor moe_experts(torch::Tensor h, torch::Tensor weights, torch::Tensor index, torch::Tensor gate_up,
                          torch::Tensor down, int64_t intermediate) {
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous(), "moe_experts: h [n, H] float32");
  TORCH_CHECK(index.dim() == 2 && index.size(0) == h.size(0) && index.scalar_type() == at::kLong &&
              index.is_contiguous(), "moe_experts: index [n, top_k] int64");
  TORCH_CHECK(weights.sizes() == index.sizes() && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
              "moe_experts: weights [n, top_k] float32");
  TORCH_CHECK(gate_up.size(0) == down.size(0) && gate_up.scalar_type() == down.scalar_type() &&
              gate_up.is_contiguous() && down.is_contiguous(), "moe_experts: gate_up, down packed alike per expert");
  const int64_t n = h.size(0), H = h.size(1), top_k = index.size(1), E = gate_up.size(0);
  const bool quantized = gate_up.scalar_type() == at::kChar || gate_up.scalar_type() == at::kByte;
  TORCH_CHECK(!quantized || (H % 32 == 0 && intermediate % 32 == 0),
              "moe_experts: quantized experts need widths in blocks of 32");
  TORCH_CHECK(gate_up.scalar_type() != at::kChar || (gate_up.dim() == 3 && down.dim() == 3),
              "moe_experts: int8 experts need [E, panels, bytes] packs");
  TORCH_CHECK(gate_up.scalar_type() != at::kByte || (gate_up.dim() == 4 && down.dim() == 4),
              "moe_experts: 4-bit experts need [E, panels, blocks, bytes] packs");
  auto out = torch::zeros({n, H}, h.options());
  if (n == 0) return out;
  const ExpertGroups g = group_by_expert(index, E);
  std::vector<int64_t> hit;
  for (int64_t e = 0; e < E; ++e)
    if (g.starts[e + 1] > g.starts[e]) hit.push_back(e);
  const int64_t P = n * top_k;
  auto order = torch::from_blob(const_cast<int64_t*>(g.pair_order.data()), {P}, torch::kLong);
  auto x = h.index_select(0, order.div(top_k, "floor"));  // [P, H] rows in expert order
  auto gu = torch::empty({P, 2 * intermediate}, h.options());
  project_groups(x, gate_up, 2 * intermediate, hit, g.starts, gu);
  auto act = at::gelu(gu.narrow(1, 0, intermediate), "tanh").mul_(gu.narrow(1, intermediate, intermediate)).contiguous();
  auto y = torch::empty({P, H}, h.options());
  project_groups(act, down, H, hit, g.starts, y);
  // each token's pairs, ascending expert: a pair's rank in expert order is its position in pair_order
  std::vector<int64_t> rank(P);
  for (int64_t i = 0; i < P; ++i) rank[g.pair_order[i]] = i;
  const float* wp = weights.data_ptr<float>();
  const int64_t* ix = index.data_ptr<int64_t>();
  const float* yp = y.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 8, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> slots(top_k);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t j = 0; j < top_k; ++j) slots[j] = t * top_k + j;
      std::sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) {
        return ix[a] < ix[b] || (ix[a] == ix[b] && a < b);
      });
      float* o = op + t * H;
      for (int64_t p : slots) {
        const float w = wp[p];
        const float* src = yp + rank[p] * H;
        for (int64_t d = 0; d < H; ++d) o[d] += src[d] * w;
      }
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(baton_cpu, m) {
  m.def("moe_experts(Tensor h, Tensor weights, Tensor index, Tensor gate_up, Tensor down, int intermediate) -> Tensor");
}
TORCH_LIBRARY_IMPL(baton_cpu, CPU, m) {
  m.impl("moe_experts", &moe_experts);
}
