// y = x @ W.T with W in a GGUF block format (Q4_0, Q4_1, Q5_0, Q8_0; the K-quants Q4_K and Q6_K) or int8 per
// channel, served in that form: 4, 5, 6 or 8 bits a weight plus the format's scales (qgemv_layout.h), never
// dequantized.
//
// As llama.cpp does, each row of x is quantized to int8 per block of 32 (scale = max |x| / 127, codes rounded
// to nearest even), so a block's dot products are integer sums, exact:
//   y[m, n] = sum over blocks b of  d_w[n, b] * d_x[m, b] * sum_k c_w[n, k] * q_x[m, k]  +  m_w[n, b] * s_x[m, b]
// with s_x[m, b] = d_x[m, b] * sum_k q_x[m, k] (the offset's share). Q4_K's d_w and m_w are its super-block's
// d and dmin times the sub-block's 6-bit sc and mn (exact in fp32); Q6_K's block sum is, in int32, the sum over
// its two halves h of sc_h * (sum_k c_w q_x - 32 sum_k q_x), times d * d_x. Per output the blocks are added in
// order with the same FMAs at every level, so the bits are the same at every level, for any rows and threads.
// The reference (shared/ops/quant.py: qgemv_ref) dequantizes both and multiplies in float64.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_isa.h"
#include "steal_for.h"
#include "qgemv_layout.h"

static inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

#define BATON_IMPL "qgemv_impl.h"
#include "isa_variants.h"

namespace {

// The u8 tensor that holds a packed weight: [panels, units, unit bytes], zeroed (codes OR their bits in)
torch::Tensor packed_zeros(const torch::Tensor& codes, int64_t units, QFormat f) {
  const int64_t panels = (codes.size(0) + kQLanes - 1) / kQLanes;
  return torch::zeros({panels, units, q_unit_bytes(f)}, codes.options());
}

void check_codes(const torch::Tensor& codes, int64_t unit, int64_t max_code, const char* op) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.size(1) % unit == 0, op,
              ": codes [N, K] uint8 with K a multiple of ", unit);
  TORCH_CHECK(codes.numel() == 0 || codes.max().item<int64_t>() <= max_code, op, ": codes above ", max_code);
}

// f(n) for every output row n, panels on threads: rows of one panel share bytes, so one thread writes a panel
// (a vocabulary's LM head is 10^8 codes)
template <typename Fn>
void for_rows_by_panel(int64_t N, const Fn& f) {
  at::parallel_for(0, (N + kQLanes - 1) / kQLanes, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin * kQLanes; n < std::min(N, end * kQLanes); ++n) f(n);
  });
}

const uint16_t* half_bits(const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>()); }

}  // namespace

// codes [N, K] u8, d / m [N, K / 32] fp16 -> [panels, K / 32, block_bytes] u8 (zero-padded outputs)
torch::Tensor qgemv_pack(torch::Tensor codes, torch::Tensor d, torch::Tensor m, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, "qgemv_pack: 4, 5 or 8 bits");
  check_codes(codes, kQBlock, (1 << bits) - 1, "qgemv_pack");
  const int64_t N = codes.size(0), K = codes.size(1), nblocks = K / kQBlock;
  TORCH_CHECK(d.sizes() == m.sizes() && d.dim() == 2 && d.size(0) == N && d.size(1) == nblocks &&
              d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf, "qgemv_pack: d, m [N, K / 32] float16");
  const QFormat f = bits == 4 ? kB4 : bits == 5 ? kB5 : kB8;
  auto packed = packed_zeros(codes, nblocks, f);
  auto c = codes.contiguous(), dc = d.contiguous(), mc = m.contiguous();
  const uint8_t* cp = c.data_ptr<uint8_t>();
  const uint16_t *dp = half_bits(dc), *mp = half_bits(mc);
  uint8_t* out = packed.data_ptr<uint8_t>();
  const int64_t cb = q_code_bytes(bits);
  for_rows_by_panel(N, [&](int64_t n) {
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t l = n % kQLanes;
      uint8_t* blk = out + ((n / kQLanes) * nblocks + b) * q_unit_bytes(f);
      for (int64_t k = 0; k < kQBlock; ++k) q_code_put(blk, static_cast<int>(bits), l, k, cp[n * K + b * kQBlock + k]);
      auto* half = reinterpret_cast<uint16_t*>(blk + cb);
      half[l] = dp[n * nblocks + b];
      half[kQLanes + l] = mp[n * nblocks + b];
    }
  });
  return packed;
}

// GGUF's super-blocks as qgemv serves them (qgemv_layout.h). Q4_K (bits 4): codes [N, K] 0..15, d / dmin
// [N, K / 256] fp16, scales / mins [N, K / 32] u8 (6-bit). Q6_K (bits 6): codes 0..63, d, scales [N, K / 16]
// int8; dmin and mins empty.
torch::Tensor qgemv_pack_k(torch::Tensor codes, torch::Tensor d, torch::Tensor dmin, torch::Tensor scales,
                           torch::Tensor mins, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 6, "qgemv_pack_k: 4 (Q4_K) or 6 (Q6_K) bits");
  check_codes(codes, kQSuper, (1 << bits) - 1, "qgemv_pack_k");
  const int64_t N = codes.size(0), K = codes.size(1), supers = K / kQSuper, sub = bits == 4 ? kQBlock : 16;
  TORCH_CHECK(d.dim() == 2 && d.size(0) == N && d.size(1) == supers && d.scalar_type() == at::kHalf,
              "qgemv_pack_k: d [N, K / 256] float16");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == K / sub &&
              scales.scalar_type() == (bits == 4 ? at::kByte : at::kChar),
              "qgemv_pack_k: scales [N, K / ", sub, "] ", bits == 4 ? "uint8" : "int8");
  if (bits == 4)
    TORCH_CHECK(dmin.sizes() == d.sizes() && dmin.scalar_type() == at::kHalf && mins.sizes() == scales.sizes() &&
                mins.scalar_type() == at::kByte, "qgemv_pack_k: Q4_K's dmin as d, mins as scales");
  const QFormat f = bits == 4 ? kQ4K : kQ6K;
  auto packed = packed_zeros(codes, supers, f);
  auto c = codes.contiguous(), dc = d.contiguous(), sc = scales.contiguous();
  auto dminc = bits == 4 ? dmin.contiguous() : dc, mc = bits == 4 ? mins.contiguous() : sc;
  const uint8_t *cp = c.data_ptr<uint8_t>(), *sp = static_cast<const uint8_t*>(sc.data_ptr()),
                *mp = static_cast<const uint8_t*>(mc.data_ptr());
  const uint16_t *dp = half_bits(dc), *dminp = half_bits(dminc);
  uint8_t* out = packed.data_ptr<uint8_t>();
  const int64_t cb = q_code_bytes(bits), nsub = kQSuper / sub;
  for_rows_by_panel(N, [&](int64_t n) {
    for (int64_t s = 0; s < supers; ++s) {
      const int64_t l = n % kQLanes;
      uint8_t* unit = out + ((n / kQLanes) * supers + s) * q_unit_bytes(f);
      for (int64_t k = 0; k < kQSuper; ++k)
        q_code_put(unit + (k / kQBlock) * cb, static_cast<int>(bits), l, k % kQBlock, cp[n * K + s * kQSuper + k]);
      uint8_t* tail = unit + kQSubBlocks * cb;
      for (int64_t j = 0; j < nsub; ++j) tail[j * kQLanes + l] = sp[n * (K / sub) + s * nsub + j];
      if (bits == 4)
        for (int64_t j = 0; j < nsub; ++j) tail[(nsub + j) * kQLanes + l] = mp[n * (K / sub) + s * nsub + j];
      auto* half = reinterpret_cast<uint16_t*>(tail + (bits == 4 ? 2 : 1) * kQSuper / sub * kQLanes);
      half[l] = dp[n * supers + s];
      if (bits == 4) half[kQLanes + l] = dminp[n * supers + s];
    }
  });
  return packed;
}

namespace {

// A batch's rows quantized for qgemv, and the view of them its loops take
struct QuantizedRows {
  torch::Tensor codes, scales, sums, sums16;
  QRows view() const {
    return {codes.data_ptr<int8_t>(), codes.size(1), scales.data_ptr<float>(), sums.data_ptr<float>(),
            scales.size(1), sums16.data_ptr<int32_t>()};
  }
};

QuantizedRows quantize_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % kQBlock == 0,
              "quantize_rows_q8: [M, K] float32 with K a multiple of ", kQBlock);
  auto xc = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), nb = K / kQBlock;
  QuantizedRows r{torch::empty({M, K}, x.options().dtype(at::kChar)), torch::empty({M, nb}, x.options()),
                  torch::empty({M, nb}, x.options()), torch::empty({M, 2 * nb}, x.options().dtype(at::kInt))};
  const float* xp = xc.data_ptr<float>();
  int8_t* cp = r.codes.data_ptr<int8_t>();
  float *sp = r.scales.data_ptr<float>(), *up = r.sums.data_ptr<float>();
  int32_t* s16 = r.sums16.data_ptr<int32_t>();
  for (int64_t i = 0; i < M * nb; ++i) {
    const float* xb = xp + i * kQBlock;
    float amax = 0.f;
    for (int64_t k = 0; k < kQBlock; ++k) amax = std::max(amax, std::fabs(xb[k]));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    int32_t half[2] = {0, 0};
    for (int64_t k = 0; k < kQBlock; ++k) {
      const auto q = static_cast<int8_t>(std::nearbyint(xb[k] * id));
      cp[i * kQBlock + k] = q;
      half[k / 16] += q;
    }
    sp[i] = d;
    up[i] = d * static_cast<float>(half[0] + half[1]);
    s16[2 * i] = half[0];
    s16[2 * i + 1] = half[1];
  }
  return r;
}

}  // namespace

// x [M, K] fp32 -> (codes [M, K] int8, scales [M, K / 32], sums [M, K / 32]) as qgemv takes its rows
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> quantize_rows_q8(torch::Tensor x) {
  auto r = quantize_rows(x);
  return {r.codes, r.scales, r.sums};
}

torch::Tensor qgemv(torch::Tensor x, torch::Tensor packed, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "qgemv: [M, K] float32 x");
  const int format = packed.dim() == 3 ? q_format_of(packed.size(2)) : -1;
  TORCH_CHECK(format >= 0 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              packed.size(1) * q_unit_inputs(static_cast<QFormat>(format)) == x.size(1),
              "qgemv: weight not packed by qgemv_pack(_k) for this input width");
  const int64_t M = x.size(0), panels = packed.size(0), N = out_features;
  TORCH_CHECK(N > (panels - 1) * kQLanes && N <= panels * kQLanes, "qgemv: out_features does not match the weight");
  const auto rows = quantize_rows(x);
  auto y = torch::empty({M, N}, x.options());
  active_kernels().qgemv_rows(rows.view(), M, packed.data_ptr<uint8_t>(), panels, packed.size(1), N, format,
                              y.data_ptr<float>());
  return y;
}

TORCH_LIBRARY_FRAGMENT(baton_cpu, m) {
  m.def("qgemv_pack(Tensor codes, Tensor d, Tensor m, int bits) -> Tensor");
  m.def("qgemv_pack_k(Tensor codes, Tensor d, Tensor dmin, Tensor scales, Tensor mins, int bits) -> Tensor");
  m.def("quantize_rows_q8(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("qgemv(Tensor x, Tensor packed, int out_features) -> Tensor");
}
TORCH_LIBRARY_IMPL(baton_cpu, CPU, m) {
  m.impl("qgemv_pack", &qgemv_pack);
  m.impl("qgemv_pack_k", &qgemv_pack_k);
  m.impl("quantize_rows_q8", &quantize_rows_q8);
  m.impl("qgemv", &qgemv);
}
