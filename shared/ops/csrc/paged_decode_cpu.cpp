// Paged attention for short query rows (decodes, draft verification) on the CPU, fp32.
//
// For each listed query row r (a token of sequence row_seq[i] at position row_pos[i]) and each query
// head: softmax over keys t in (pos - window, pos] of q·k_t * scale, times v_t. Keys and values are
// read in place from the paged cache through the block table, so nothing is gathered into a
// contiguous copy first (the torch reference's cost: a copy of every sequence's context per layer).
// One job per (row, KV head) computes the whole query group of that head, so each key and value
// vector is loaded once for all heads that share it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

void paged_decode(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor block_tables, torch::Tensor rows, torch::Tensor row_seq, torch::Tensor row_pos,
                  double scale, int64_t window) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
              v_cache.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && rows.scalar_type() == at::kLong &&
              row_seq.scalar_type() == at::kLong && row_pos.scalar_type() == at::kLong, "index dtypes");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "head_dim must be contiguous");
  TORCH_CHECK(block_tables.stride(1) == 1 && rows.is_contiguous() && row_seq.is_contiguous() &&
              row_pos.is_contiguous(), "index tensors must be contiguous");
  const int64_t R = rows.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2), G = Hq / Hkv;
  const float* q = query.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const int64_t kbs = k_cache.stride(0), kts = k_cache.stride(1), khs = k_cache.stride(2);
  const int64_t vbs = v_cache.stride(0), vts = v_cache.stride(1), vhs = v_cache.stride(2);
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t btw = block_tables.stride(0);
  const int64_t* ri = rows.data_ptr<int64_t>();
  const int64_t* rs = row_seq.data_ptr<int64_t>();
  const int64_t* rp = row_pos.data_ptr<int64_t>();
  const int64_t qrs = query.stride(0), qhs = query.stride(1), ors = out.stride(0), ohs = out.stride(1);
  at::parallel_for(0, R * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    std::vector<float> inv(G);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t i = job / Hkv, h = job % Hkv, r = ri[i];
      const int64_t pos = rp[i];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      const int64_t n = pos - lo + 1;
      scores.assign(G * n, 0.f);
      const int32_t* table = bt + rs[i] * btw;
      for (int64_t t = 0; t < n; ++t) {
        const int64_t p = lo + t;
        const float* k = kc + table[p / bs] * kbs + (p % bs) * kts + h * khs;
        for (int64_t g = 0; g < G; ++g) {
          const float* qq = q + r * qrs + (h * G + g) * qhs;
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s += qq[d] * k[d];
          scores[g * n + t] = s * (float)scale;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sc = scores.data() + g * n;
        float m = *std::max_element(sc, sc + n);
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) { sc[t] = std::exp(sc[t] - m); sum += sc[t]; }
        inv[g] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t p = lo + t;
        const float* v = vc + table[p / bs] * vbs + (p % bs) * vts + h * vhs;
        for (int64_t g = 0; g < G; ++g) {
          const float w = scores[g * n + t];
          float* a = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) a[d] += w * v[d];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* oo = o + r * ors + (h * G + g) * ohs;
        for (int64_t d = 0; d < D; ++d) oo[d] = acc[g * D + d] * inv[g];
      }
    }
  });
}

TORCH_LIBRARY(baton_cpu, m) {
  m.def("paged_decode(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor rows, Tensor row_seq, Tensor row_pos, float scale, int window) -> ()");
}
TORCH_LIBRARY_IMPL(baton_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
