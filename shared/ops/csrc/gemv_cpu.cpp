// y = x @ W.T for a decode batch's rows of x (up to GEMV_MAX_ROWS in shared/ops/linear.py), fp32, reading W
// once at memory speed.
//
// oneDNN's packed GEMM streams SmolLM2's weights at 18-27 GB/s on two cores at one row; this reads them at
// 32-35 GB/s, DRAM speed. Rows go through a panel in passes of up to kRowsPerPass (the later passes read it
// from L2), the last pass taking whatever rows are left in one go: a pass's FMAs overlap the panel's stream
// from DRAM, so the fewer passes, the closer a few rows cost what one row costs (bench/linear.py).
// It is only worth having if it changes no result: a request must give the same tokens alone (here) and in a
// big batch (oneDNN). So every output is summed in oneDNN's order, found by experiment and checked per weight
// when it is packed (shared/ops/linear.py):
//   y[m, n] = sequential FMA chain over k in blocks of k_block, each block's chain starting from 0,
//             the blocks' partial sums added in order.
// k_block is oneDNN's K blocking, which depends on the CPU and the weight: 1024 on the AVX2 machines we
// measured; on AVX-512 (Zen 4) 512 for K <= 1024 and 1024 above. The caller finds it per weight.
// Rows are independent (vector lanes span outputs, never k), so the result is also the same for any
// number of rows and threads.
//
// Weight layout: [N / kGemvLanes, K, kGemvLanes], N padded with zeros: a panel of kGemvLanes outputs is one
// contiguous stream in k, which the hardware prefetcher follows.
//
// The loops (gemv_impl.h) are compiled once per instruction-set level and picked by cpu_isa.cpp.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_isa.h"
#include "steal_for.h"
#include "gemv_layout.h"

torch::Tensor gemv_pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "gemv_pack: 2-D float32 weight");
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kGemvLanes - 1) / kGemvLanes;
  auto padded = torch::zeros({panels * kGemvLanes, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({panels, kGemvLanes, K}).transpose(1, 2).contiguous();
}

#define BATON_IMPL "gemv_impl.h"
#include "isa_variants.h"

torch::Tensor gemv(torch::Tensor x, torch::Tensor packed, int64_t out_features, int64_t k_block) {
  return active_kernels().gemv_f32(std::move(x), std::move(packed), out_features, k_block);
}

TORCH_LIBRARY_FRAGMENT(baton_cpu, m) {
  m.def("gemv_pack(Tensor weight) -> Tensor");
  m.def("gemv(Tensor x, Tensor packed, int out_features, int k_block) -> Tensor");
}
TORCH_LIBRARY_IMPL(baton_cpu, CPU, m) {
  m.impl("gemv_pack", &gemv_pack);
  m.impl("gemv", &gemv);
}
