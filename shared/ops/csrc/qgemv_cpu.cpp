// y = x @ W.T with W in a GGUF-style block format (Q4_0, Q4_1, Q8_0) or int8 per channel, served in that form:
// 4 or 8 bits a weight plus a fp16 scale and offset per block of 32 (qgemv_layout.h), never dequantized.
//
// As llama.cpp does, each row of x is quantized to int8 per block of 32 (scale = max |x| / 127, codes rounded
// to nearest even), so a block's dot products are integer sums, exact:
//   y[m, n] = sum over blocks b of  d_w[n, b] * d_x[m, b] * sum_k c_w[n, k] * q_x[m, k]  +  m_w[n, b] * s_x[m, b]
// with s_x[m, b] = d_x[m, b] * sum_k q_x[m, k] (the offset's share). Per output the blocks are added in order
// with the same two FMAs at every level, so the bits are the same at every level, for any rows and threads.
// The reference (shared/ops/quant.py) computes the same formula in torch.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_isa.h"
#include "qgemv_layout.h"

static inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

#define BATON_IMPL "qgemv_impl.h"
#include "isa_variants.h"

// codes [N, K] u8, d / m [N, K / kQBlock] fp16 -> [panels, K / kQBlock, block_bytes] u8 (zero-padded outputs)
torch::Tensor qgemv_pack(torch::Tensor codes, torch::Tensor d, torch::Tensor m, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "qgemv_pack: 4 or 8 bits");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.size(1) % kQBlock == 0,
              "qgemv_pack: codes [N, K] uint8 with K a multiple of ", kQBlock);
  const int64_t N = codes.size(0), K = codes.size(1), nblocks = K / kQBlock;
  TORCH_CHECK(d.sizes() == m.sizes() && d.dim() == 2 && d.size(0) == N && d.size(1) == nblocks &&
              d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf, "qgemv_pack: d, m [N, K / 32] float16");
  if (bits == 4) TORCH_CHECK(codes.max().item<int64_t>() < 16, "qgemv_pack: 4-bit codes above 15");
  const int64_t panels = (N + kQLanes - 1) / kQLanes, bb = q_block_bytes(bits), cb = q_code_bytes(bits);
  auto packed = torch::zeros({panels, nblocks, bb}, codes.options());
  auto c = codes.contiguous(), dc = d.contiguous(), mc = m.contiguous();
  const uint8_t* cp = c.data_ptr<uint8_t>();
  const auto* dp = reinterpret_cast<const uint16_t*>(dc.data_ptr<at::Half>());
  const auto* mp = reinterpret_cast<const uint16_t*>(mc.data_ptr<at::Half>());
  uint8_t* out = packed.data_ptr<uint8_t>();
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t b = 0; b < nblocks; ++b) {
      uint8_t* blk = out + (p * nblocks + b) * bb;
      auto* half = reinterpret_cast<uint16_t*>(blk + cb);
      for (int64_t l = 0; l < std::min(kQLanes, N - p * kQLanes); ++l) {
        const int64_t n = p * kQLanes + l;
        for (int64_t k = 0; k < kQBlock; ++k) {
          const int64_t q = k / 4, v = l * 4 + k % 4;
          const uint8_t code = cp[n * K + b * kQBlock + k];
          if (bits == 8) blk[q * 64 + v] = code;
          else blk[q * 32 + v % 32] |= v < 32 ? code : static_cast<uint8_t>(code << 4);
        }
        half[l] = dp[n * nblocks + b];
        half[kQLanes + l] = mp[n * nblocks + b];
      }
    }
  return packed;
}

// x [M, K] fp32 -> (codes [M, K] int8, scales [M, K / 32], sums [M, K / 32]) as qgemv takes its rows
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> quantize_rows_q8(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % kQBlock == 0,
              "quantize_rows_q8: [M, K] float32 with K a multiple of ", kQBlock);
  auto xc = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), nb = K / kQBlock;
  auto codes = torch::empty({M, K}, x.options().dtype(at::kChar));
  auto scales = torch::empty({M, nb}, x.options()), sums = torch::empty({M, nb}, x.options());
  const float* xp = xc.data_ptr<float>();
  int8_t* cp = codes.data_ptr<int8_t>();
  float* sp = scales.data_ptr<float>();
  float* up = sums.data_ptr<float>();
  for (int64_t i = 0; i < M * nb; ++i) {
    const float* xb = xp + i * kQBlock;
    float amax = 0.f;
    for (int64_t k = 0; k < kQBlock; ++k) amax = std::max(amax, std::fabs(xb[k]));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    int32_t s = 0;
    for (int64_t k = 0; k < kQBlock; ++k) {
      const auto q = static_cast<int8_t>(std::nearbyint(xb[k] * id));
      cp[i * kQBlock + k] = q;
      s += q;
    }
    sp[i] = d;
    up[i] = d * static_cast<float>(s);
  }
  return {codes, scales, sums};
}

torch::Tensor qgemv(torch::Tensor x, torch::Tensor packed, int64_t out_features, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "qgemv: 4 or 8 bits");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "qgemv: [M, K] float32 x");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              packed.size(2) == q_block_bytes(bits) && packed.size(1) * kQBlock == x.size(1),
              "qgemv: weight not packed by qgemv_pack for this input width and bit count");
  const int64_t M = x.size(0), panels = packed.size(0), N = out_features;
  TORCH_CHECK(N > (panels - 1) * kQLanes && N <= panels * kQLanes, "qgemv: out_features does not match the weight");
  auto [codes, scales, sums] = quantize_rows_q8(x);
  auto y = torch::empty({M, N}, x.options());
  const QRows rows{codes.data_ptr<int8_t>(), x.size(1), scales.data_ptr<float>(), sums.data_ptr<float>(),
                   packed.size(1)};
  active_kernels().qgemv_rows(rows, M, packed.data_ptr<uint8_t>(), panels, packed.size(1), N, bits,
                              y.data_ptr<float>());
  return y;
}

TORCH_LIBRARY_FRAGMENT(baton_cpu, m) {
  m.def("qgemv_pack(Tensor codes, Tensor d, Tensor m, int bits) -> Tensor");
  m.def("quantize_rows_q8(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("qgemv(Tensor x, Tensor packed, int out_features, int bits) -> Tensor");
}
TORCH_LIBRARY_IMPL(baton_cpu, CPU, m) {
  m.impl("qgemv_pack", &qgemv_pack);
  m.impl("quantize_rows_q8", &quantize_rows_q8);
  m.impl("qgemv", &qgemv);
}
