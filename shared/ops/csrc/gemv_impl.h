// The fp32 GEMV's loops, compiled once per instruction-set level (isa_variants.h; the contract and the
// layout are in gemv_cpu.cpp). Only the passes' width and the prefetch differ between levels: every output
// is the same sequential FMA chain at any vector width, so every level gives the same bits.

// Rows per pass over a panel: two fill AVX2's 16 registers with partial sums; AVX-512's 32 registers hold
// eight rows' (two registers each) with room for the panel's vectors. On Zen 4, passes of 8 rows instead of
// 4 took a model's projections at 8 rows from 20.5 to 16.3 ms (one row: 15.5) and at 32 rows from 54 to 39.
constexpr int kRowsPerPass = BATON_ISA >= BATON_ISA_AVX512 ? 8 : 2;
// With more than one pass, the passes after the first read the panel from L2 while DRAM sits idle, so every
// pass also pulls a slice of the thread's next panel into L2 and the stream runs through all of them. On
// Zen 4, SmolLM2's projections (A/B in one process, medians of 21, same bits): 16 rows 24.9-25.1 ms instead
// of 28.5, 32 rows 3-5% less. Prefetching in a lone pass as well cost 1-4 rows 10-30%, so one pass keeps to
// the hardware prefetcher. The gain was sensitive to the code's shape (the same prefetches from a variant
// that built each slice in a lambda gained nothing): re-run the A/B when touching this loop. Not measured on
// AVX2, where it stays off.
constexpr bool kPrefetchNextPanel = BATON_ISA >= BATON_ISA_AVX512;

// MR rows of x against one panel: out[m][l] for l < ncols
template <int MR>
static inline void panel_rows(const float* __restrict x, int64_t ldx, const float* __restrict panel, int64_t K,
                              float* __restrict y, int64_t ldy, int64_t ncols, int64_t k_block,
                              const float* ahead, int64_t ahead_rows) {
  // ahead (nullptr: none): ahead_rows k rows of the next panel to pull into L2, spread evenly over the K steps
  float total[MR][kGemvLanes];
  int64_t ahead_due = 0;
  for (int64_t k0 = 0; k0 < K; k0 += k_block) {
    const int64_t k1 = std::min(K, k0 + k_block);
    float acc[MR][kGemvLanes] = {};
    for (int64_t k = k0; k < k1; ++k) {
      const float* __restrict w = panel + k * kGemvLanes;
      ahead_due += ahead_rows;
      if (ahead != nullptr && ahead_due >= K) {
        ahead_due -= K;
        __builtin_prefetch(ahead, 0, 2);  // into L2: a panel outgrows L1
        __builtin_prefetch(ahead + 16, 0, 2);  // a k row of the panel is two cache lines
        ahead += kGemvLanes;
      }
      for (int m = 0; m < MR; ++m) {
        const float xv = x[m * ldx + k];
#pragma omp simd
        for (int l = 0; l < kGemvLanes; ++l) acc[m][l] = std::fma(xv, w[l], acc[m][l]);
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int l = 0; l < kGemvLanes; ++l) total[m][l] = k0 == 0 ? acc[m][l] : total[m][l] + acc[m][l];
  }
  for (int m = 0; m < MR; ++m)
    for (int64_t l = 0; l < ncols; ++l) y[m * ldy + l] = total[m][l];
}

// The rows left after the full passes, 0 < rest < R + 1, in one pass of exactly that many.
template <int R>
static inline void tail_rows(int64_t rest, const float* x, int64_t ldx, const float* panel, int64_t K, float* y,
                             int64_t ldy, int64_t ncols, int64_t k_block, const float* ahead, int64_t ahead_rows) {
  if constexpr (R > 0) {
    if (rest == R) return panel_rows<R>(x, ldx, panel, K, y, ldy, ncols, k_block, ahead, ahead_rows);
    tail_rows<R - 1>(rest, x, ldx, panel, K, y, ldy, ncols, k_block, ahead, ahead_rows);
  }
}

torch::Tensor gemv_f32(torch::Tensor x, torch::Tensor packed, int64_t out_features, int64_t k_block) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "gemv: contiguous float32 x");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kGemvLanes && packed.size(1) == x.size(1) &&
              packed.is_contiguous(), "gemv: weight not packed by gemv_pack for this input width");
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0), N = out_features;
  TORCH_CHECK(N > (panels - 1) * kGemvLanes && N <= panels * kGemvLanes,
              "gemv: out_features does not match the weight");
  TORCH_CHECK(k_block > 0, "gemv: k_block must be positive");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // panels split across threads, never k: each output's sum is the same whatever the thread count; a thread
  // done with its own takes the others' last (steal_for.h)
  parallel_steal_steps(panels, 4, [&](int64_t p, int64_t after) {
    const float* panel = wp + p * K * kGemvLanes;
    const int64_t ncols = std::min(kGemvLanes, N - p * kGemvLanes);
    // the thread's next panel, a slice of its k rows per pass (none with one pass, or after the last panel)
    const int64_t passes = (M + kRowsPerPass - 1) / kRowsPerPass;
    const float* next = kPrefetchNextPanel && passes > 1 && after >= 0 ? wp + after * K * kGemvLanes : nullptr;
    const int64_t slice = (K + passes - 1) / passes;
    int64_t m = 0, pass = 0;
    for (; m + kRowsPerPass <= M; m += kRowsPerPass, ++pass)
      panel_rows<kRowsPerPass>(xp + m * K, K, panel, K, yp + m * N + p * kGemvLanes, N, ncols, k_block,
                               next ? next + std::min(K, pass * slice) * kGemvLanes : nullptr,
                               std::max<int64_t>(0, std::min(slice, K - pass * slice)));
    tail_rows<kRowsPerPass - 1>(M - m, xp + m * K, K, panel, K, yp + m * N + p * kGemvLanes, N, ncols, k_block,
                                next ? next + std::min(K, pass * slice) * kGemvLanes : nullptr,
                                std::max<int64_t>(0, std::min(slice, K - pass * slice)));
  });
  return y;
}

