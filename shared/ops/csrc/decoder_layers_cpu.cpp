// A decode step's whole layer loop in one call on the CPU: what CUDA graphs are to kernel launches, this is to
// Python's dispatch. From Python, each of a layer's ~20 ops costs a few microseconds of interpreter and
// dispatcher work before its kernel starts. That is about 2 ms of a SmolLM2 step (30 layers), which is 11% at
// one row. Here the same kernels run in the same order on the same tensors, called directly, so the results
// are the same bits as `DecoderLM._layer` (tested).
//
// It covers the steps the CPU kernels cover whole: every sequence's rows go to paged_decode (decodes and
// short verify chunks), and every projection to gemv (a decode batch). shared/models/cpu_layer_loop.py
// decides when it runs, and builds this once per model from the model's own tensors.
#include <torch/custom_class.h>
#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "kernels_cpu.h"

namespace {

// A projection as the GEMV kernels take it: the weight packed by gemv_pack (fp32; with its K blocking), by
// gemv_bf16_pack (bf16), by qgemv_pack(_k) (u8 codes, their format told by the unit's size) or by w8a8_pack
// (int8), and its output width.
struct Projection {
  torch::Tensor packed;
  int64_t out_features;
  int64_t k_block;
  torch::Tensor operator()(const torch::Tensor& x) const {
    if (packed.scalar_type() == at::kBFloat16) return gemv_bf16(x.contiguous(), packed, out_features);
    if (packed.scalar_type() == at::kByte) return qgemv(x, packed, out_features);
    if (packed.scalar_type() == at::kChar) return w8a8(x, packed, out_features);
    return gemv(x.contiguous(), packed, out_features, k_block);
  }
  // silu(gate) * up of a gate_up projection, with silu_mul(operator()(x))'s bits: the kernel's own op where it
  // has one (W8A8, bf16), which runs it as one pass where that pays
  torch::Tensor silu_gated(const torch::Tensor& x) const {
    if (packed.scalar_type() == at::kBFloat16) return gemv_bf16_silu(x.contiguous(), packed, out_features);
    if (packed.scalar_type() == at::kChar) return w8a8_silu(x, packed, out_features);
    return silu_mul((*this)(x));
  }
};

// rms_norm_cpu's contract (shared/ops/norm_rope_cpu.py): over the last dim, any leading shape
torch::Tensor norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  return rms_norm_rows(x.reshape({-1, x.size(-1)}), weight, eps).view(x.sizes());
}

}  // namespace

struct DecoderLayers : torch::CustomClassHolder {
  // Per layer, in this order: qkv, o, gate_up, down.
  static constexpr int64_t kProjections = 4;
  // Per layer, in this order; an empty tensor where the model has no such norm.
  static constexpr int64_t kNorms = 6;
  enum Norm { kIn = 0, kFfnIn, kAttnOut, kFfnOut, kQ, kK };

  std::vector<Projection> projections;
  std::vector<torch::Tensor> norms;
  std::vector<int64_t> windows;     // per layer, 0 = global
  std::vector<int64_t> rope_index;  // per layer: which of forward's cos / sin tables
  int64_t num_layers, num_heads, num_kv_heads, head_dim;
  double eps, scale;
  bool gelu_tanh;  // the MLP's activation: GELU (tanh) where true, else SiLU

  DecoderLayers(std::vector<torch::Tensor> packed, std::vector<int64_t> out_features, std::vector<int64_t> k_blocks,
                std::vector<torch::Tensor> norms_, std::vector<int64_t> windows_, std::vector<int64_t> rope_index_,
                int64_t num_heads_, int64_t num_kv_heads_, int64_t head_dim_, double eps_, double scale_,
                bool gelu_tanh_)
      : norms(std::move(norms_)), windows(std::move(windows_)), rope_index(std::move(rope_index_)),
        num_layers(static_cast<int64_t>(windows.size())), num_heads(num_heads_), num_kv_heads(num_kv_heads_),
        head_dim(head_dim_), eps(eps_), scale(scale_), gelu_tanh(gelu_tanh_) {
    const auto L = static_cast<size_t>(num_layers);
    TORCH_CHECK(packed.size() == L * kProjections && out_features.size() == packed.size() &&
                k_blocks.size() == packed.size() && norms.size() == L * kNorms && rope_index.size() == L,
                "DecoderLayers: per-layer lists of the wrong length");
    for (size_t j = 0; j < packed.size(); ++j) projections.push_back({packed[j], out_features[j], k_blocks[j]});
  }

  const torch::Tensor& norm_of(int64_t layer, Norm which) const { return norms[layer * kNorms + which]; }

  // x [n, hidden] (the embeddings); cos / sin [n, head_dim] per rope table; kv_cache
  // [layers, blocks, 2, block_size, Hkv, D]; the attention rows as paged_decode takes them.
  // Returns (x, m): the residual stream before the last layer's MLP output m is added (DecoderLM.forward
  // fuses that add into the final norm).
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x, std::vector<torch::Tensor> cos,
                                                   std::vector<torch::Tensor> sin, torch::Tensor kv_cache,
                                                   torch::Tensor slot_mapping, torch::Tensor block_tables,
                                                   torch::Tensor rows, torch::Tensor row_seq,
                                                   torch::Tensor row_pos) {
    TORCH_CHECK(num_layers > 0 && kv_cache.size(0) == num_layers, "DecoderLayers: cache for another model");
    const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    torch::Tensor m, h;
    for (int64_t i = 0; i < num_layers; ++i) {
      const Projection* w = &projections[i * kProjections];
      if (i == 0) {
        h = norm(x, norm_of(i, kIn), eps);
      } else {
        std::tie(x, h) = add_rms_norm_rows(x.contiguous(), m.contiguous(), norm_of(i, kIn), eps);
      }
      auto qkv = w[0](h).split_with_sizes({q_size, kv_size, kv_size}, -1);
      auto q = qkv[0].view({-1, num_heads, head_dim});
      auto k = qkv[1].view({-1, num_kv_heads, head_dim});
      auto v = qkv[2].view({-1, num_kv_heads, head_dim});
      if (norm_of(i, kQ).numel() > 0) {
        q = norm(q, norm_of(i, kQ), eps);
        k = norm(k, norm_of(i, kK), eps);
      }
      const auto r = static_cast<size_t>(rope_index[i]);
      rope_(q, k, cos[r], sin[r]);
      auto layer_cache = kv_cache.select(0, i);
      auto k_cache = layer_cache.select(1, 0), v_cache = layer_cache.select(1, 1);
      write_kv_(k_cache, v_cache, k, v, slot_mapping);
      auto a = torch::empty_like(q);
      paged_decode(a, q, k_cache, v_cache, block_tables, rows, row_seq, row_pos, scale, windows[i]);
      a = w[1](a.reshape({-1, q_size}));
      if (norm_of(i, kAttnOut).numel() > 0) a = norm(a, norm_of(i, kAttnOut), eps);
      std::tie(x, h) = add_rms_norm_rows(x.contiguous(), a.contiguous(), norm_of(i, kFfnIn), eps);
      torch::Tensor act;
      if (gelu_tanh) {
        auto halves = w[2](h).chunk(2, -1);
        act = at::gelu(halves[0], "tanh") * halves[1];
      } else {
        act = w[2].silu_gated(h);
      }
      m = w[3](act);
      if (norm_of(i, kFfnOut).numel() > 0) m = norm(m, norm_of(i, kFfnOut), eps);
    }
    return {x, m};
  }
};

TORCH_LIBRARY_FRAGMENT(baton_cpu, m) {
  m.class_<DecoderLayers>("DecoderLayers")
      .def(torch::init<std::vector<torch::Tensor>, std::vector<int64_t>, std::vector<int64_t>,
                       std::vector<torch::Tensor>, std::vector<int64_t>, std::vector<int64_t>, int64_t, int64_t,
                       int64_t, double, double, bool>())
      .def("forward", &DecoderLayers::forward);
}
