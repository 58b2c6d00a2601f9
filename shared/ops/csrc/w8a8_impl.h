// The W8A8 GEMM's loops, compiled once per instruction-set level (isa_variants.h; contract and layout in
// w8a8_cpu.cpp). Every level sums each block's products exactly as integers and folds the blocks into the
// output with the same fp32 FMAs in the same order, so the bits are the same at every level, for any rows and
// threads:
//   avx512_bf16 and up (AVX512-VNNI): vpdpbusd, u8 rows (q + 128) times the s8 weights, four products summed
//     per int32 lane, 64 a zmm instruction; each block's sum starts at -128 times its weights' sum
//   avx2, avx512: vpmaddubsw on |q| and the weights signed by q (no pair sum reaches int16's limit), then
//     vpmaddwd to int32
//   portable: plain integer loops

// A panel's first pass over the rows streams it from DRAM (a decode step's weights are far past the caches);
// the hardware prefetcher alone left the stream at 18-24 GB/s of ~33. That pass also prefetches into L2 the
// bytes kW8PrefetchAhead on (which run on into the thread's next panel: its panels lie end to end). A/B on
// Zen 4, two threads, 30 layers of SmolLM2's four projections (106 MB), medians of 9 interleaved (ms, with
// against without): 1 row 4.37 / 5.75, 6 rows 6.09 / 7.11, 8 rows 6.59 / 7.00, 16 rows 8.91 / 9.26, 32 rows
// 13.55 / 14.40, 64 rows 6.39 / 6.94 (8 layers); 1, 2 and 8 KiB ahead did no better; at 256 rows it is level
// and at 2048 rows 2% slower (the weights are reused from the caches by every row block), so it stays off
// above kW8StreamMaxRows. Measured on the VNNI path; the avx2 loops take the same prefetches.
constexpr int64_t kW8PrefetchAhead = 4096;
constexpr int64_t kW8StreamMaxRows = 256;
// With more than one pass over a panel (7 to kW8StreamMaxRows rows: a decode batch), only the first read it
// from DRAM and the others computed from L1 with the memory bus idle. The later passes now prefetch the
// thread's next panel into L2, each its share spread over its blocks, so that stream overlaps their
// arithmetic and the next panel's first pass finds it in L2 (bench/next_panel_prefetch.py: 1.25x a pass at
// 32 rows on Zen 5). No sum changes.

#include "gated_rows.h"  // inside the level's namespace: the row loop with its SiLU epilogue
#include "panel_prefetch.h"  // the later passes' share of the next panel
#include "reduce8.h"  // reduce_max8: a block's max |x| at avx2

// Rows per pass over a panel: with VNNI six rows' block sums and running outputs (four zmm a row) stay in
// registers beside the two weight registers and the block's two offsets
constexpr int kW8Rows = BATON_ISA >= BATON_ISA_AVX512_BF16 ? 6 : 2;

// A row quantized per block of kW8Block as qgemv_cpu.cpp quantizes it (scale d = max |x| / 127, codes
// nearbyint(x / d)), stored as q + 128 for vpdpbusd's unsigned operand
static void w8_quantize_row(const float* x, int64_t K, uint8_t* q, float* scales) {
  for (int64_t b = 0; b < K / kW8Block; ++b) {
    const float* xb = x + b * kW8Block;
    uint8_t* qb = q + b * kW8Block;
    float amax = 0.f;
#if BATON_ISA >= BATON_ISA_AVX512
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
#elif BATON_ISA >= BATON_ISA_AVX2
    // a prompt chunk quantizes every row of every projection; the plain loop below takes a value at a time
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i] = _mm256_loadu_ps(xb + 8 * i)));
    amax = reduce_max8(m);
#else
    for (int64_t k = 0; k < kW8Block; ++k) amax = std::max(amax, std::fabs(xb[k]));
#endif
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    scales[b] = d;
#if BATON_ISA >= BATON_ISA_AVX512
    const __m512 vid = _mm512_set1_ps(id);
    const __m512i offset = _mm512_set1_epi32(128);
    const __m512i c0 = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_roundscale_ps(
        _mm512_mul_ps(v0, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)), offset);
    const __m512i c1 = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_roundscale_ps(
        _mm512_mul_ps(v1, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)), offset);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtepi32_epi8(c0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtepi32_epi8(c1));
#elif BATON_ISA >= BATON_ISA_AVX2
    // nearbyint's rounding (to nearest even), then int32 -> int8 by two saturating packs (nothing saturates:
    // |code| <= 127), whose lane interleave the permute undoes, and q + 128 as q's bits with the top one flipped
    __m256i c[4];
    for (int i = 0; i < 4; ++i)
      c[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(id)),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    const __m256i ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), _mm256_xor_si256(ordered, _mm256_set1_epi8((char)0x80)));
#else
    for (int64_t k = 0; k < kW8Block; ++k)
      qb[k] = static_cast<uint8_t>(static_cast<int32_t>(std::nearbyint(xb[k] * id)) + 128);
#endif
  }
}

// MR rows against one panel: out[m][l] = sw[l] * (the blocks' fp32 fold of d_x[m, b] * sum_k q_x q_w)
template <int MR, bool kStream>
static void w8_panel_rows(const uint8_t* xq, int64_t ldx, const float* sx, int64_t lds, const int8_t* panel,
                          int64_t blocks, float* y, int64_t ldy, int64_t ncols, PanelPrefetch next) {
  const auto* offsets = reinterpret_cast<const int32_t*>(panel + blocks * kW8Block * kW8Lanes);
  const auto* sw = reinterpret_cast<const float*>(offsets + blocks * kW8Lanes);
  float out[MR][kW8Lanes];
#if BATON_ISA >= BATON_ISA_AVX512_BF16
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  int64_t line = 0;  // the next line of `next` to prefetch, spread over the blocks
  for (int64_t b = 0; b < blocks; ++b) {
    prefetch_share_upto(next, line, b + 1, blocks);
    const int8_t* w = panel + b * kW8Block * kW8Lanes;
    const __m512i o0 = _mm512_loadu_si512(offsets + b * kW8Lanes), o1 = _mm512_loadu_si512(offsets + b * kW8Lanes + 16);
    __m512i sum[MR][2];
    for (int m = 0; m < MR; ++m) sum[m][0] = o0, sum[m][1] = o1;
    for (int64_t kq = 0; kq < kW8Block / 4; ++kq) {
      if constexpr (kStream) {
        __builtin_prefetch(w + kW8PrefetchAhead + kq * 4 * kW8Lanes, 0, 2);
        __builtin_prefetch(w + kW8PrefetchAhead + kq * 4 * kW8Lanes + 64, 0, 2);
      }
      const __m512i w0 = _mm512_loadu_si512(w + kq * 4 * kW8Lanes), w1 = _mm512_loadu_si512(w + kq * 4 * kW8Lanes + 64);
      for (int m = 0; m < MR; ++m) {
        int32_t quad;
        std::memcpy(&quad, xq + m * ldx + b * kW8Block + 4 * kq, 4);
        const __m512i xb = _mm512_set1_epi32(quad);
        sum[m][0] = _mm512_dpbusd_epi32(sum[m][0], xb, w0);
        sum[m][1] = _mm512_dpbusd_epi32(sum[m][1], xb, w1);
      }
    }
    for (int m = 0; m < MR; ++m) {
      const __m512 d = _mm512_set1_ps(sx[m * lds + b]);
      acc[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[m][0]), d, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[m][1]), d, acc[m][1]);
    }
  }
  const __m512 s0 = _mm512_loadu_ps(sw), s1 = _mm512_loadu_ps(sw + 16);
  for (int m = 0; m < MR; ++m) {
    _mm512_storeu_ps(out[m], _mm512_mul_ps(acc[m][0], s0));
    _mm512_storeu_ps(out[m] + 16, _mm512_mul_ps(acc[m][1], s1));
  }
#elif BATON_ISA >= BATON_ISA_AVX2
  // vpmaddubsw on |q| and the weights signed by q, vpmaddwd to int32: 32 products in four instructions, the
  // weights' four registers shared by the pass's rows; each block's sums fold into fp32 sums kept in L1
  alignas(32) float acc[MR][kW8Lanes] = {};
  // the block's q (signed) and |q| of each row, made once per block rather than once per quad and weight
  // register: the quads are then broadcast from L1, and the loop keeps no constant but `ones` (with `flip`
  // too, two rows' sums, the weights, the constants and the quad took all 16 registers: two sums spilled)
  alignas(32) int32_t xsig[MR][kW8Block / 4], xabs[MR][kW8Block / 4];
  const __m256i ones = _mm256_set1_epi16(1);
  int64_t line = 0;  // the next line of `next` to prefetch, spread over the blocks
  for (int64_t b = 0; b < blocks; ++b) {
    prefetch_share_upto(next, line, b + 1, blocks);
    const int8_t* w = panel + b * kW8Block * kW8Lanes;
    __m256i s[MR][4];
    for (int m = 0; m < MR; ++m) {
      const __m256i xs = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * ldx + b * kW8Block)),
                                          _mm256_set1_epi8(static_cast<char>(0x80)));
      _mm256_store_si256(reinterpret_cast<__m256i*>(xsig[m]), xs);
      _mm256_store_si256(reinterpret_cast<__m256i*>(xabs[m]), _mm256_abs_epi8(xs));
      for (int j = 0; j < 4; ++j) s[m][j] = _mm256_setzero_si256();
    }
    for (int64_t kq = 0; kq < kW8Block / 4; ++kq) {
      if constexpr (kStream) {
        __builtin_prefetch(w + kW8PrefetchAhead + kq * 4 * kW8Lanes, 0, 2);
        __builtin_prefetch(w + kW8PrefetchAhead + kq * 4 * kW8Lanes + 64, 0, 2);
      }
      __m256i wv[4];
      for (int j = 0; j < 4; ++j) wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kq * 4 * kW8Lanes + 32 * j));
      for (int m = 0; m < MR; ++m) {
        const __m256i xs = _mm256_set1_epi32(xsig[m][kq]), xa = _mm256_set1_epi32(xabs[m][kq]);
        for (int j = 0; j < 4; ++j)
          s[m][j] = _mm256_add_epi32(s[m][j], _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(wv[j], xs)), ones));
      }
    }
    for (int m = 0; m < MR; ++m) {
      const __m256 d = _mm256_set1_ps(sx[m * lds + b]);
      for (int j = 0; j < 4; ++j)
        _mm256_store_ps(acc[m] + 8 * j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[m][j]), d, _mm256_load_ps(acc[m] + 8 * j)));
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j)
      _mm256_storeu_ps(out[m] + 8 * j, _mm256_mul_ps(_mm256_load_ps(acc[m] + 8 * j), _mm256_loadu_ps(sw + 8 * j)));
#else
  (void)next;
  float acc[MR][kW8Lanes] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* w = panel + b * kW8Block * kW8Lanes;
    int32_t sum[MR][kW8Lanes];
    for (int m = 0; m < MR; ++m)
      for (int64_t l = 0; l < kW8Lanes; ++l) {
        int32_t s = 0;
        for (int64_t k = 0; k < kW8Block; ++k)
          s += (static_cast<int32_t>(xq[m * ldx + b * kW8Block + k]) - 128) * w[(k / 4) * 4 * kW8Lanes + 4 * l + k % 4];
        sum[m][l] = s;
      }
    for (int m = 0; m < MR; ++m)
      for (int64_t l = 0; l < kW8Lanes; ++l)
        acc[m][l] = std::fma(static_cast<float>(sum[m][l]), sx[m * lds + b], acc[m][l]);
  }
  for (int m = 0; m < MR; ++m)
    for (int64_t l = 0; l < kW8Lanes; ++l) out[m][l] = acc[m][l] * sw[l];
#endif
  for (int m = 0; m < MR; ++m)
    for (int64_t l = 0; l < ncols; ++l) y[m * ldy + l] = out[m][l];
}

// One pass of exactly `rest` rows (0 < rest <= R); `stream`: the pass that reads the panel from DRAM
template <int R>
static inline void w8_pass(int64_t rest, const uint8_t* xq, int64_t ldx, const float* sx, int64_t lds,
                                const int8_t* panel, int64_t blocks, float* y, int64_t ldy, int64_t ncols,
                                bool stream, PanelPrefetch next) {
  if constexpr (R > 0) {
    if (rest == R) {
      if (stream) return w8_panel_rows<R, true>(xq, ldx, sx, lds, panel, blocks, y, ldy, ncols, next);
      return w8_panel_rows<R, false>(xq, ldx, sx, lds, panel, blocks, y, ldy, ncols, next);
    }
    w8_pass<R - 1>(rest, xq, ldx, sx, lds, panel, blocks, y, ldy, ncols, stream, next);
  }
}

void w8a8_rows(const float* x, int64_t M, int64_t K, const int8_t* packed, int64_t panels, int64_t N, float* y,
               SiluColsFn silu) {
  const int64_t blocks = K / kW8Block, panel_bytes = w8_panel_bytes(K);
  std::vector<uint8_t> xq(M * K);
  std::vector<float> sx(M * blocks);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) w8_quantize_row(x + m * K, K, xq.data() + m * K, sx.data() + m * blocks);
  });
  // a thread's panels pass over a block of rows that stays in L2 (a prompt chunk's rows would not)
  const int64_t row_block = std::max<int64_t>(kW8Rows, kW8RowBlockBytes / K / kW8Rows * kW8Rows);
  const bool stream = M <= kW8StreamMaxRows;  // the first pass over each panel prefetches ahead
  const bool prefetch_next = stream && w8_next_prefetch.load(std::memory_order_relaxed);
  // With `silu`, gate_up and silu(gate) * up in one pass (gated_rows.h): a prompt chunk's gate_up, 25 MB a
  // layer at 2,048 rows, is never written nor read back
  const int64_t width = silu ? 2 : 1, steps = panels / width;  // panels a step runs
  // panels split across threads, never k: each output's fold is the same whatever the threads and rows. A
  // thread owns a contiguous range of steps (its panels lie end to end, which the next-panel prefetch
  // follows) and runs it row block by row block; one done early takes the others' last (row block, step)
  // items, back to front (steal_for.h).
  parallel_steal_blocks(steps, 1, (M + row_block - 1) / row_block, [&](int64_t b, int64_t p, int64_t after) {
    alignas(64) float out[2][kW8Rows * kW8Lanes];
    const int64_t m0 = b * row_block, m1 = std::min(M, m0 + row_block);
    const int64_t passes = (m1 - m0 + kW8Rows - 1) / kW8Rows;
    // the rows [m, m + rest) of M against panel q (gate or up of step p with silu), into dst
    auto pass = [&](int64_t q, int64_t m, int64_t rest, float* dst, int64_t ldd, int64_t ncols) {
      const int8_t* panel = packed + q * panel_bytes;
      const int8_t* next = prefetch_next && after >= 0 ? panel + (after - p) * panel_bytes : nullptr;
      const PanelPrefetch share = next_panel_share(next, panel_bytes, (m - m0) / kW8Rows, passes, INT64_MAX);
      w8_pass<kW8Rows>(rest, xq.data() + m * K, K, sx.data() + m * blocks, blocks, panel, blocks, dst, ldd,
                       ncols, stream && m == 0, share);
    };
    gated_rows<kW8Rows, kW8Lanes>(m0, m1, p, steps, N, y, silu, out, pass);
  });
}
