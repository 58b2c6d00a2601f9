// y = x @ W.T with W int8 per output channel (shared/ops/quant.py: int8_per_channel) and the rows of x
// quantized to int8 per block of 32 as they arrive, exactly as qgemv_cpu.cpp quantizes them (llama.cpp's
// Q8_0 x Q8_0): the same numbers qgemv computes for these weights, summed faster. A block's products are one
// exact integer sum; the blocks fold into the output in order, then the channel's scale:
//   y[m, n] = s_w[n] * fold over blocks b of  fma(float(sum_{k in b} q_x[m, k] q_w[n, k]), d_x[m, b], .)
// The per-channel weight scale leaves the inner loop nothing but vpdpbusd (64 multiply-adds an instruction,
// twice vdpbf16ps's) and a convert and an FMA per block, where qgemv's generic block formats (a scale and an
// offset per block of each output, in fp16) cost as much again: that left int8 no faster than bf16 at the
// batch sizes a server runs (bench/linear.py).
//
// Packed weight: int8 [panels, w8_panel_bytes(K)] (K a multiple of kW8Block); a panel is kW8Lanes outputs:
//   codes    K / 4 quads of kW8Lanes x 4 int8 (output l, inputs 4 kq .. 4 kq + 3 at byte 4 l + j), zero past N
//   offsets  K / kW8Block x kW8Lanes int32: -128 times the block's codes' sum (vpdpbusd's u8 rows are q + 128)
//   s_w      kW8Lanes fp32 (the per-channel scale)
// The int8 dtype is how the C++ layer loop (decoder_layers_cpu.cpp) tells it from qgemv's u8 blocks.
//
// The reference (shared/ops/w8a8.py: w8a8_ref) computes the same integer sums, in int64, and the same fold.
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

#include "cpu_isa.h"
#include "kernels_cpu.h"
#include "steal_for.h"

constexpr int64_t kW8Lanes = 32;
constexpr int64_t kW8Block = 32;
// rows a thread's panels pass over while they stay in L2 (u8 rows: 256 KiB of them)
constexpr int64_t kW8RowBlockBytes = 256 * 1024;

constexpr int64_t w8_panel_bytes(int64_t K) { return K * kW8Lanes + (K / kW8Block) * kW8Lanes * 4 + kW8Lanes * 4; }

// Whether a decode batch's later passes over a panel prefetch the next one (w8a8_impl.h); on by default.
// bench/next_panel_prefetch.py turns it off and on in turn through w8a8_next_prefetch to compare in one process.
static std::atomic<bool> w8_next_prefetch{true};

bool w8a8_next_prefetch(bool on) { return w8_next_prefetch.exchange(on); }

#define BATON_IMPL "w8a8_impl.h"
#include "isa_variants.h"

// codes [N, K] uint8 (q + 128, as int8_per_channel stores them, q in -127..127), scale [N] fp32
torch::Tensor w8a8_pack(torch::Tensor codes, torch::Tensor scale) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.size(1) % kW8Block == 0,
              "w8a8_pack: codes [N, K] uint8 with K a multiple of ", kW8Block);
  TORCH_CHECK(scale.dim() == 1 && scale.scalar_type() == at::kFloat && scale.size(0) == codes.size(0),
              "w8a8_pack: scale [N] float32");
  TORCH_CHECK(codes.numel() == 0 || codes.min().item<int64_t>() >= 1, "w8a8_pack: code 0 (q = -128) is not int8's");
  const int64_t N = codes.size(0), K = codes.size(1), blocks = K / kW8Block, panels = (N + kW8Lanes - 1) / kW8Lanes;
  const auto q = (codes.to(at::kInt) - 128).to(at::kChar).contiguous();
  const auto offsets = (q.to(at::kInt).view({N, blocks, kW8Block}).sum(2, false, at::kInt) * -128).contiguous();
  const auto s = scale.contiguous();
  auto packed = torch::zeros({panels, w8_panel_bytes(K)}, codes.options().dtype(at::kChar));
  const int8_t* qp = q.data_ptr<int8_t>();
  const int32_t* op = offsets.data_ptr<int32_t>();
  const float* sp = s.data_ptr<float>();
  int8_t* out = packed.data_ptr<int8_t>();
  at::parallel_for(0, panels, 16, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      int8_t* panel = out + p * w8_panel_bytes(K);
      auto* po = reinterpret_cast<int32_t*>(panel + K * kW8Lanes);
      auto* sw = reinterpret_cast<float*>(po + blocks * kW8Lanes);
      for (int64_t l = 0; l < kW8Lanes && p * kW8Lanes + l < N; ++l) {
        const int64_t n = p * kW8Lanes + l;
        for (int64_t k = 0; k < K; ++k) panel[(k / 4) * 4 * kW8Lanes + 4 * l + k % 4] = qp[n * K + k];
        for (int64_t b = 0; b < blocks; ++b) po[b * kW8Lanes + l] = op[n * blocks + b];
        sw[l] = sp[n];
      }
    }
  });
  return packed;
}

static void check_w8a8(const torch::Tensor& x, const torch::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % kW8Block == 0,
              "w8a8: [M, K] float32 x with K a multiple of ", kW8Block);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
              packed.size(1) == w8_panel_bytes(x.size(1)), "w8a8: weight not packed by w8a8_pack for this input width");
  const int64_t panels = packed.size(0);
  TORCH_CHECK(N > (panels - 1) * kW8Lanes && N <= panels * kW8Lanes, "w8a8: out_features does not match the weight");
}

torch::Tensor w8a8(torch::Tensor x, torch::Tensor packed, int64_t out_features) {
  check_w8a8(x, packed, out_features);
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  const auto xc = x.contiguous();
  auto y = torch::empty({M, N}, x.options());
  if (M > 0)
    active_kernels().w8a8_rows(xc.data_ptr<float>(), M, K, packed.data_ptr<int8_t>(), packed.size(0), N,
                               y.data_ptr<float>(), nullptr);
  return y;
}

// Rows from which w8a8_silu runs as one pass: a prompt chunk's. Zen 5, SmolLM2's 30 gate_up projections,
// one pass against the two ops in turn: 2,048 rows 153 against 179 ms, 256 and 32 rows level, 8 rows 1.93
// against 1.68 (two panels streamed side by side from DRAM, where the two ops stream one)
constexpr int64_t kW8FusedSiluMinRows = 257;

// The MLP's gate_up projection and silu(gate) * up, with silu_mul(w8a8(...))'s bits: from
// kW8FusedSiluMinRows rows in one pass (the gate and up panels of each 32 outputs run together and their
// sums go through silu_mul's own form from the stack), below it or where gate and up are not whole panels
// (out_features / 2 not a multiple of 32) the two ops.
torch::Tensor w8a8_silu(torch::Tensor x, torch::Tensor packed, int64_t out_features) {
  TORCH_CHECK(out_features % 2 == 0, "w8a8_silu: out_features is gate's and up's, an even number");
  if (out_features % (2 * kW8Lanes) != 0 || x.size(0) < kW8FusedSiluMinRows)
    return silu_mul(w8a8(std::move(x), std::move(packed), out_features));
  check_w8a8(x, packed, out_features);
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  const auto xc = x.contiguous();
  auto y = torch::empty({M, N / 2}, x.options());
  if (M > 0)
    active_kernels().w8a8_rows(xc.data_ptr<float>(), M, K, packed.data_ptr<int8_t>(), packed.size(0), N,
                               y.data_ptr<float>(), silu_mul_cols());
  return y;
}

TORCH_LIBRARY_FRAGMENT(baton_cpu, m) {
  m.def("w8a8_pack(Tensor codes, Tensor scale) -> Tensor");
  m.def("w8a8(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def("w8a8_silu(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def("w8a8_next_prefetch(bool on) -> bool", &w8a8_next_prefetch);
}
TORCH_LIBRARY_IMPL(baton_cpu, CPU, m) {
  m.impl("w8a8_pack", &w8a8_pack);
  m.impl("w8a8", &w8a8);
  m.impl("w8a8_silu", &w8a8_silu);
}
