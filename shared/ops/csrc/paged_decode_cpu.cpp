// Paged attention for short query rows (decodes, draft verification) on the CPU, fp32.
//
// For each listed query row r (a token of sequence row_seq[i] at position row_pos[i]) and each query
// head: softmax over keys t in (pos - window, pos] of q·k_t * scale, times v_t. Keys and values are
// read in place from the paged cache through the block table, so nothing is gathered into a
// contiguous copy first (the torch reference's cost: a copy of every sequence's context per layer).
// A job is one row (or, when there are few rows, part of its KV heads): each key and value vector is
// loaded once for all query heads that share it, and a token's keys for all heads are one read.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd_dot.h"

// exp(x) for x <= 0 (scores minus their row's max), written so that `omp simd` vectorises it: libm's
// expf stays one scalar call per score (glibc's vector expf needs -ffast-math for the whole file).
// Cephes' expf: x = k ln2 + r with |r| <= ln2 / 2, a degree-7 polynomial for exp(r), 2^k through the
// exponent bits. Relative error about 1e-7, as libm's.
static inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;  // below this 2^k leaves the normal range; exp is < 2e-38 anyway
  const float k = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Keys (and values) are prefetched this many positions ahead, through the block table. Measured at batch
// 32, 260-token contexts, 30 layers' caches, blocks scattered over the pool, two threads: 1.22 ms per
// layer prefetching only within a block (past its end lies another sequence's block), 0.85 ms with this.
constexpr int kPrefetchAhead = 8;

// fn(t, block, slot, ahead_block, ahead_slot) for the keys at positions lo + t, t < n, walking the block
// table a block at a time; (ahead_block, ahead_slot) is where the key kPrefetchAhead positions on lives
// (blocks are anywhere in the pool, so the hardware prefetcher cannot follow a sequence past its block)
template <typename Fn>
static inline void for_each_slot(const int32_t* table, int64_t bs, int64_t lo, int64_t n, Fn&& fn) {
  int64_t t = 0;
  const int64_t last_block = (lo + n - 1) / bs;
  while (t < n) {
    const int64_t p = lo + t, b = p / bs, block = table[b], first = p % bs;
    const int64_t next = b < last_block ? table[b + 1] : block;
    const int64_t count = std::min(bs - first, n - t);
    for (int64_t j = 0; j < count; ++j) {
      const int64_t ahead = first + j + kPrefetchAhead;
      fn(t + j, block, first + j, ahead < bs ? block : next, ahead < bs ? ahead : std::min(ahead - bs, bs - 1));
    }
    t += count;
  }
}

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
  const float fscale = (float)scale;
  // A job is a row's KV heads [h0, h1): the whole row when rows alone keep every thread busy (a token's
  // keys for all heads are then one contiguous read), else the row's heads split across jobs
  const int64_t threads = at::get_num_threads();
  const int64_t splits = std::clamp<int64_t>((2 * threads + R - 1) / R, 1, Hkv);
  const int64_t heads_per_job = (Hkv + splits - 1) / splits;
  at::parallel_for(0, R * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc, inv;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t i = job / splits, r = ri[i];
      const int64_t h0 = (job % splits) * heads_per_job, h1 = std::min(Hkv, h0 + heads_per_job);
      if (h0 >= h1) continue;
      const int64_t nq = (h1 - h0) * G;  // query heads of this job, in order h0 * G ...
      const int64_t pos = rp[i];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      const int64_t n = pos - lo + 1;
      scores.resize(nq * n);
      const int32_t* table = bt + rs[i] * btw;
      const float* qj = q + r * qrs + h0 * G * qhs;
      for_each_slot(table, bs, lo, n, [&](int64_t t, int64_t block, int64_t slot, int64_t pb, int64_t ps) {
        const float* kt = kc + block * kbs + slot * kts;
        const float* kp = kc + pb * kbs + ps * kts;
        for (int64_t h = h0; h < h1; ++h) {
          const float* k = kt + h * khs;
          for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(kp + h * khs + d);
          for (int64_t g = 0; g < G; ++g) {
            const int64_t j = (h - h0) * G + g;
            scores[j * n + t] = dot(qj + j * qhs, k, D) * fscale;
          }
        }
      });
      inv.resize(nq);
      for (int64_t j = 0; j < nq; ++j) {
        float* sc = scores.data() + j * n;
        float m = sc[0];
#pragma omp simd reduction(max : m)
        for (int64_t t = 1; t < n; ++t) m = std::max(m, sc[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < n; ++t) {
          const float e = exp_nonpositive(sc[t] - m);
          sc[t] = e;
          sum += e;
        }
        inv[j] = 1.f / sum;
      }
      // weights times values, a token at a time for all the job's heads (the sums, nq * D floats, stay in L1)
      acc.assign(nq * D, 0.f);
      for_each_slot(table, bs, lo, n, [&](int64_t t, int64_t block, int64_t slot, int64_t pb, int64_t ps) {
        const float* vt = vc + block * vbs + slot * vts;
        const float* vp = vc + pb * vbs + ps * vts;
        for (int64_t h = h0; h < h1; ++h) {
          const float* __restrict v = vt + h * vhs;
          for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(vp + h * vhs + d);
          for (int64_t g = 0; g < G; ++g) {
            const int64_t j = (h - h0) * G + g;
            const float w = scores[j * n + t];
            float* __restrict a = acc.data() + j * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += w * v[d];
          }
        }
      });
      for (int64_t j = 0; j < nq; ++j) {
        float* oo = o + r * ors + (h0 * G + j) * ohs;
        for (int64_t d = 0; d < D; ++d) oo[d] = acc[j * D + d] * inv[j];
      }
    }
  });
}

TORCH_LIBRARY_FRAGMENT(baton_cpu, m) {
  m.def("paged_decode(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor rows, Tensor row_seq, Tensor row_pos, float scale, int window) -> ()");
}
TORCH_LIBRARY_IMPL(baton_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
