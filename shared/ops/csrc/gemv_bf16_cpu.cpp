// y = x @ W.T with W stored as bf16, for the rows of any batch (decode steps and prompt chunks): half the
// bytes of fp32 weights, so a decode step streams half as much from DRAM.
//
// Weight layout: [N / kGemvLanes, ceil(K / 2), kGemvLanes, 2] bf16, N padded with zero rows and K with a zero
// column: a panel of kGemvLanes outputs is one contiguous stream in k, and each k pair of an output is one
// 32-bit lane, the operand vdpbf16ps multiplies (and, widened, two fp32 lanes for the FMA paths).
//
// Each output is one chain over k in order, per row: the result does not depend on the number of rows or
// threads (batch invariant), but it does on the level (gemv_bf16_impl.h): vdpbf16ps rounds the row to bf16,
// the widening paths do not. The reference is F.linear against the bf16-rounded weight (and row).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "amx_tiles.h"
#include "cpu_isa.h"
#include "steal_for.h"
#include "gemv_layout.h"
#include "kernels_cpu.h"

torch::Tensor gemv_bf16_pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "gemv_bf16_pack: 2-D float32 or bfloat16 weight");
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kGemvLanes - 1) / kGemvLanes;
  const int64_t K2 = (K + 1) / 2;
  auto padded = torch::zeros({panels * kGemvLanes, 2 * K2}, weight.options().dtype(at::kBFloat16));
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);  // torch's rounding to nearest even
  return padded.view({panels, kGemvLanes, K2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// How far ahead of the tile loads (bytes) the amx level prefetches a weight it streams from DRAM; 0: not at
// all. bench/tile_prefetch.py sets it through gemv_bf16_prefetch to compare distances in one process: on
// Sapphire Rapids (tile_prefetch-20261127-221009, two threads, SmolLM2's projections, 135 MB a pass) 4-32 KB
// all gave 1.13-1.21x at 1 to 32 rows, 1.05-1.14x at 64, and 0.97-0.99x (noise) at 256, where the tiles'
// arithmetic, not DRAM, bounds a pass.
static std::atomic<int64_t> tile_prefetch_bytes{16 << 10};

int64_t gemv_bf16_prefetch(int64_t bytes) {
  TORCH_CHECK(bytes >= 0 && bytes % 64 == 0 && bytes <= (1 << 20), "gemv_bf16_prefetch: whole lines, at most 1 MiB");
  return tile_prefetch_bytes.exchange(bytes);
}

// Whether the levels below amx prefetch the next panel in a decode batch's later passes over a panel (up to
// this many rows, as the W8A8 kernel streams); on by default. bench/next_panel_prefetch.py turns it off and on
// in turn through gemv_bf16_next_prefetch to compare in one process.
constexpr int64_t kBf16NextPrefetchMaxRows = 256;
static std::atomic<bool> bf16_next_prefetch{true};

bool gemv_bf16_next_prefetch(bool on) { return bf16_next_prefetch.exchange(on); }

#define BATON_IMPL "gemv_bf16_impl.h"
#define BATON_IMPL_AMX
#include "isa_variants.h"

torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor packed, int64_t out_features) {
  return active_kernels().gemv_bf16(std::move(x), std::move(packed), out_features, nullptr);
}

// Rows from which the levels below amx run gemv_bf16_silu as one pass: a prompt chunk's. Zen 5, SmolLM2's 30
// gate_up projections, one pass against the two ops in turn: 2,048 rows 250 against 275 ms, 256 and 32 rows
// level, 8 rows 3.03 against 2.77 (two panels streamed side by side from DRAM, where the two ops stream one)
constexpr int64_t kBf16FusedSiluMinRows = 257;

// The MLP's gate_up projection and silu(gate) * up in one pass (the [M, 2I] projection never reaches memory)
// where gate and up are whole panels, on the amx tiles at any row count and below them from
// kBf16FusedSiluMinRows rows; else the two ops. The bits are silu_mul(gemv_bf16(...))'s either way.
torch::Tensor gemv_bf16_silu(torch::Tensor x, torch::Tensor packed, int64_t out_features) {
  TORCH_CHECK(out_features % 2 == 0, "gemv_bf16_silu: out_features is gate's and up's, an even number");
  if (out_features % (2 * kGemvLanes) == 0 &&
      (active_kernels().isa == Isa::kAmx || x.size(0) >= kBf16FusedSiluMinRows))
    return active_kernels().gemv_bf16(std::move(x), std::move(packed), out_features, silu_mul_cols());
  return silu_mul(gemv_bf16(std::move(x), std::move(packed), out_features));
}

TORCH_LIBRARY_FRAGMENT(baton_cpu, m) {
  m.def("gemv_bf16_pack(Tensor weight) -> Tensor");
  m.def("gemv_bf16(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def("gemv_bf16_silu(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def("gemv_bf16_prefetch(int bytes) -> int", &gemv_bf16_prefetch);
  m.def("gemv_bf16_next_prefetch(bool on) -> bool", &gemv_bf16_next_prefetch);
}
TORCH_LIBRARY_IMPL(baton_cpu, CPU, m) {
  m.impl("gemv_bf16_pack", &gemv_bf16_pack);
  m.impl("gemv_bf16", &gemv_bf16);
  m.impl("gemv_bf16_silu", &gemv_bf16_silu);
}
