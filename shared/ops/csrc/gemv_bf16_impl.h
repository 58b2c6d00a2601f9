// The bf16 GEMV's loops, compiled once per instruction-set level (isa_variants.h; contract and layout in
// gemv_bf16_cpu.cpp). avx512_bf16 and up: vdpbf16ps over the rows rounded to bf16 (two products per lane
// and instruction, as oneDNN's and vLLM's bf16 paths round activations). Below it the weights are widened in
// registers (a shift or a mask per pair of k; 256-bit on AVX2, 512-bit on AVX-512) and multiply the fp32 rows
// exactly: half the bytes, fp32 arithmetic. amx: the same bf16 rows and panels through tiles (below).

#include "gated_rows.h"  // inside the level's namespace: the row loop with its SiLU epilogue
#include "panel_prefetch.h"  // the later passes' share of the next panel

// Rows per pass over a panel: with AVX-512 eight rows' partial sums (two registers each) stay in registers.
constexpr int kBf16RowsPerPass = BATON_ISA >= BATON_ISA_AVX512 ? 8 : 2;

#if BATON_ISA >= BATON_ISA_AVX512
// The panel's pair kk as fp32: [0] the even k of outputs 0-15, [1] the odd k; [2], [3] outputs 16-31
static inline void widen_pair_avx512(const uint16_t* w, __m512 (&out)[4]) {
  const __m512i lo = _mm512_loadu_si512(w), hi = _mm512_loadu_si512(w + 32);
  const __m512i odd_mask = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  out[0] = _mm512_castsi512_ps(_mm512_slli_epi32(lo, 16));
  out[1] = _mm512_castsi512_ps(_mm512_and_si512(lo, odd_mask));
  out[2] = _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16));
  out[3] = _mm512_castsi512_ps(_mm512_and_si512(hi, odd_mask));
}
#endif

// Pairs of k between two looks at the next panel's prefetch (panel_prefetch.h: not in the pair loop)
constexpr int64_t kBf16PrefetchChunk = 16;
// At most this many lines a pass (24 KB): a panel of SmolLM2's is 36-96 KB, and with two passes (9-16 rows)
// the second prefetching all of the next one made 16 rows 0.87x; the lines a cap leaves out stream on the
// next panel's first pass as before. Zen 5, a pass over the projections, off against on in turn
// (next_panel_prefetch-20261129-0411*, -0414*, -0417*): no cap 16 rows 0.87x, 32 rows 1.24x; 12 KB 1.04x,
// 1.16x; 24 KB 1.08x, 1.18x (24 rows 1.23x, 64 1.08x)
constexpr int64_t kBf16PrefetchMaxLines = 384;

// MR rows against one panel of K2 pairs: y[m][l] for l < ncols. x: fp32 rows (widening paths) or bf16 pairs
// as uint32 (vdpbf16ps), ldx elements apart. `next`: lines of the next panel to prefetch meanwhile
// (avx512_bf16 and up; the levels below ignore it).
template <int MR>
static void bf16_panel_rows(const float* x, const uint32_t* xpairs, int64_t ldx, const uint16_t* panel, int64_t K2,
                            int64_t K, float* y, int64_t ldy, int64_t ncols, PanelPrefetch next) {
  float out[MR][kGemvLanes];
#if BATON_ISA >= BATON_ISA_AVX512_BF16
  (void)x;
  (void)K;
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  int64_t line = 0;  // the next line of `next` to prefetch
  for (int64_t k0 = 0; k0 < K2; k0 += kBf16PrefetchChunk) {
    const int64_t k1 = std::min(K2, k0 + kBf16PrefetchChunk);
    prefetch_share_upto(next, line, k1, K2);
    for (int64_t kk = k0; kk < k1; ++kk) {
      const uint16_t* w = panel + kk * 2 * kGemvLanes;
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32);
      for (int m = 0; m < MR; ++m) {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xpairs[m * ldx + kk]));
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, xb);
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, xb);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm512_storeu_ps(out[m], acc[m][0]);
    _mm512_storeu_ps(out[m] + 16, acc[m][1]);
  }
#elif BATON_ISA >= BATON_ISA_AVX512
  (void)xpairs;
  (void)next;
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < K2; ++kk) {
    __m512 w[4];
    widen_pair_avx512(panel + kk * 2 * kGemvLanes, w);
    const int64_t k = 2 * kk;
    for (int m = 0; m < MR; ++m) {
      const __m512 x0 = _mm512_set1_ps(x[m * ldx + k]);
      const __m512 x1 = _mm512_set1_ps(k + 1 < K ? x[m * ldx + k + 1] : 0.f);
      acc[m][0] = _mm512_fmadd_ps(x1, w[1], _mm512_fmadd_ps(x0, w[0], acc[m][0]));
      acc[m][1] = _mm512_fmadd_ps(x1, w[3], _mm512_fmadd_ps(x0, w[2], acc[m][1]));
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm512_storeu_ps(out[m], acc[m][0]);
    _mm512_storeu_ps(out[m] + 16, acc[m][1]);
  }
#elif BATON_ISA >= BATON_ISA_AVX2
  (void)xpairs;
  (void)next;
  // a pair kk's 32 lanes as 4 groups of 8: one 256-bit load holds a group's even and odd k, widened by a
  // shift (even) and a mask (odd); the FMAs in the widening paths' order
  __m256 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < 4; ++g) acc[m][g] = _mm256_setzero_ps();
  const __m256i odd_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t kk = 0; kk < K2; ++kk) {
    const uint16_t* w = panel + kk * 2 * kGemvLanes;
    const int64_t k = 2 * kk;
    for (int g = 0; g < 4; ++g) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * g));
      const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(raw, odd_mask));
      for (int m = 0; m < MR; ++m) {
        const __m256 x0 = _mm256_set1_ps(x[m * ldx + k]);
        const __m256 x1 = _mm256_set1_ps(k + 1 < K ? x[m * ldx + k + 1] : 0.f);
        acc[m][g] = _mm256_fmadd_ps(x1, wo, _mm256_fmadd_ps(x0, we, acc[m][g]));
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < 4; ++g) _mm256_storeu_ps(out[m] + 8 * g, acc[m][g]);
#else
  (void)xpairs;
  (void)next;
  // portable: lanes l of the pair kk sit at
  // [l * 2] (even k) and [l * 2 + 1] (odd k)
  float acc[MR][kGemvLanes] = {};
  for (int64_t kk = 0; kk < K2; ++kk) {
    const uint16_t* w = panel + kk * 2 * kGemvLanes;
    float we[kGemvLanes], wo[kGemvLanes];
    for (int l = 0; l < kGemvLanes; ++l) {
      we[l] = bf16_bits_to_float(w[2 * l]);
      wo[l] = bf16_bits_to_float(w[2 * l + 1]);
    }
    const int64_t k = 2 * kk;
    for (int m = 0; m < MR; ++m) {
      const float x0 = x[m * ldx + k], x1 = k + 1 < K ? x[m * ldx + k + 1] : 0.f;
#pragma omp simd
      for (int l = 0; l < kGemvLanes; ++l) acc[m][l] = std::fma(x1, wo[l], std::fma(x0, we[l], acc[m][l]));
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int l = 0; l < kGemvLanes; ++l) out[m][l] = acc[m][l];
#endif
  for (int m = 0; m < MR; ++m)
    for (int64_t l = 0; l < ncols; ++l) y[m * ldy + l] = out[m][l];
}

// One pass of exactly `rest` rows (0 < rest <= R)
template <int R>
static inline void bf16_pass(int64_t rest, const float* x, const uint32_t* xpairs, int64_t ldx,
                             const uint16_t* panel, int64_t K2, int64_t K, float* y, int64_t ldy, int64_t ncols,
                             PanelPrefetch next) {
  if constexpr (R > 0) {
    if (rest == R) return bf16_panel_rows<R>(x, xpairs, ldx, panel, K2, K, y, ldy, ncols, next);
    bf16_pass<R - 1>(rest, x, xpairs, ldx, panel, K2, K, y, ldy, ncols, next);
  }
}

// The rows rounded to bf16 (to nearest even, once, not per panel) as the pairs vdpbf16ps and TDPBF16PS take:
// [rows, ld] uint32, k pair kk of row m at [m * ld + kk]; what lies past M rows and K2 pairs is left as it is.
// 32 values an instruction with vcvtne2ps2bf16 (which reads subnormal floats as zero, as vdpbf16ps and the
// tiles read subnormal bf16), the rest one by one: a prompt chunk's rows are 1 ms of scalar rounding. Only the
// levels that multiply bf16 rows have it: below avx512_bf16 the rows stay fp32.
#if BATON_ISA >= BATON_ISA_AVX512_BF16
static void bf16_row_pairs(const float* x, int64_t M, int64_t K, int64_t K2, int64_t ld, uint32_t* pairs) {
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = x + m * K;
      int64_t kk = 0;
      for (; 2 * kk + 32 <= K; kk += 16) {
        const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + 2 * kk + 16), _mm512_loadu_ps(row + 2 * kk));
        _mm512_storeu_si512(pairs + m * ld + kk, (__m512i)b);
      }
      for (; kk < K2; ++kk) {
        const uint32_t lo = float_to_bf16_bits(row[2 * kk]);
        const uint32_t hi = 2 * kk + 1 < K ? float_to_bf16_bits(row[2 * kk + 1]) : 0u;
        pairs[m * ld + kk] = lo | (hi << 16);
      }
    }
  });
}
#endif

#if BATON_ISA >= BATON_ISA_AMX
// AMX: TDPBF16PS multiplies a tile of 16 rows by 16 k pairs with a tile of 16 pairs by 16 outputs into 16 x 16
// fp32 sums: 8,192 products an instruction against vdpbf16ps's 32. The panel layout is already the B operand:
// a pair row of a panel's outputs 0-15 is its first 64 bytes (16-31 the next 64), so tiles load straight from
// the weight, 128 bytes a row apart. Rows are zero-padded to whole tiles of 16 (a decode step's one row too:
// at one row the step streams the weight and the tiles keep up with DRAM).
//
// The tiles do not sum in vdpbf16ps's order (measured on Sapphire Rapids: neither chain order of a pair nor
// one rounding per tile reproduces TDPBF16PS's bits), so this level sends every row count through the
// tiles: a row's bits still depend on neither the other rows nor the threads, only on the level.
constexpr int64_t kTilePairs = kTileRowBytes / 4;  // k pairs a row tile holds

// tmm0-3: the sums (row tile 0 or 1 x outputs 0-15 or 16-31); tmm4, tmm5: two row tiles; tmm6, tmm7: the
// panel's two halves. Every tile is 16 rows of 64 bytes.
static void amx_configure_bf16() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.set(t, kTileRows, kTileRowBytes);
  _tile_loadconfig(&cfg);
}

// A pass that streams the weight from DRAM prefetches it into L2 tile_prefetch_bytes (gemv_bf16_cpu.cpp) ahead
// of its tile loads: a tile load's 16 lines wait for memory with nothing else in flight, and the hardware
// prefetchers do not run far enough ahead of them. Panels of a thread lie back to back, so the stream runs on
// across them.
//
// RT row tiles (16 * RT rows of `pairs`, ld pairs apart, K2p pairs zero-padded to whole tiles) against one
// panel: sums [16 * RT][kGemvLanes] into out, ldo floats a row apart. Pairs past the panel's whole tiles come
// from `tail` (the panel's last pairs, zero-padded to a tile). With `prefetch` > 0 (on the first pass over the
// weight; later passes find it in L2) each tile step prefetches what lies that many bytes on.
template <int RT>
static void amx_panel_rows(const uint32_t* pairs, int64_t ld, const uint16_t* panel, int64_t K2, int64_t K2p,
                           const uint16_t* tail, float* out, int64_t ldo, int64_t prefetch) {
  constexpr int64_t kRowStride = 4 * kGemvLanes;  // bytes from one pair row of a panel to the next
  constexpr int64_t kStepBytes = kTilePairs * kRowStride;  // a tile step's share of the panel
  const int64_t whole = K2 / kTilePairs * kTilePairs;
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (RT == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k0 = 0; k0 < K2p; k0 += kTilePairs) {
    const uint16_t* w = k0 < whole ? panel + k0 * 2 * kGemvLanes : tail;
    if (prefetch > 0) {
      const char* ahead = reinterpret_cast<const char*>(panel + k0 * 2 * kGemvLanes) + prefetch;
      for (int64_t line = 0; line < kStepBytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T1);
    }
    _tile_loadd(6, w, kRowStride);
    _tile_loadd(7, w + kGemvLanes, kRowStride);
    _tile_loadd(4, pairs + k0, ld * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (RT == 2) {
      _tile_loadd(5, pairs + kTileRows * ld + k0, ld * 4);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, out, ldo * 4);
  _tile_stored(1, out + 16, ldo * 4);
  if constexpr (RT == 2) {
    _tile_stored(2, out + kTileRows * ldo, ldo * 4);
    _tile_stored(3, out + kTileRows * ldo + 16, ldo * 4);
  }
}

// Panels a thread keeps in L2 while every row passes them (half of Sapphire Rapids' 2 MB)
constexpr int64_t kTilePanelBytes = 1 << 20;

// The rows rounded to bf16 pairs as the tiles read them, ld pairs apart, zero-padded to whole tiles
struct TileRows {
  int64_t Mp, K2p, ld;
  std::vector<uint32_t> pairs;
};

static TileRows tile_rows(const float* x, int64_t M, int64_t K, int64_t K2) {
  TileRows t;
  t.Mp = (M + kTileRows - 1) / kTileRows * kTileRows;
  t.K2p = (K2 + kTilePairs - 1) / kTilePairs * kTilePairs;
  // rows an odd number of cache lines apart: at an even number a row tile's 16 loads fall on fewer L1 sets
  // (3,072 bytes, SmolLM2's down projection, on 4); about 5% at 2,048 rows
  t.ld = (t.K2p * 4 / 64) % 2 == 0 ? t.K2p + 16 : t.K2p;
  t.pairs.assign(t.Mp * t.ld, 0u);
  bf16_row_pairs(x, M, K, K2, t.ld, t.pairs.data());
  return t;
}

// Rows a pass over a block of panels takes: two row tiles, but at 17-32 rows (a decode batch) one in each of
// two passes. With two row tiles in flight the first pass, which streams the weight from DRAM, stalls on its
// tile loads' misses with four products queued behind them; one tile keeps up with DRAM, and the second 16
// rows then cost a pass from L2. bench/tile_prefetch.py, three rounds in turn against two tiles on Sapphire
// Rapids (tile_prefetch-20261127-2220*-at-any-rows): 32 rows 1.10-1.34x; the same split at 48 rows
// 0.99-1.21x and at 64 0.90-0.95x, so from 33 rows two passes of two tiles stay.
static int64_t amx_pass_rows(int64_t m, int64_t M) {
  return m == 0 && M <= 2 * kTileRows ? kTileRows : 2 * kTileRows;
}

// The rows from m (amx_pass_rows, or the 16 that remain) of M against one panel, sums into out, ldo floats a
// row apart
static void amx_rows(const TileRows& t, int64_t m, int64_t M, const uint16_t* panel, int64_t K2,
                     const uint16_t* tail, float* out, int64_t ldo, int64_t prefetch) {
  const uint32_t* rows = t.pairs.data() + m * t.ld;
  prefetch = m == 0 ? prefetch : 0;
  if (amx_pass_rows(m, M) == 2 * kTileRows && t.Mp - m >= 2 * kTileRows)
    amx_panel_rows<2>(rows, t.ld, panel, K2, t.K2p, tail, out, ldo, prefetch);
  else
    amx_panel_rows<1>(rows, t.ld, panel, K2, t.K2p, tail, out, ldo, prefetch);
}

// The loop order is a GEMM's, not a GEMV's: a block of panels (the weight, up to kTilePanelBytes) stays in L2
// while each 32 rows pass all of it, writing their outputs as runs of the row. Panel by panel over every row
// (as the vdpbf16ps path goes) streams a prompt chunk's rows from L3 once per panel and writes the output a
// column at a time, one page per row: at 2,048 rows it took 1.2-2x as long (one and two threads, Sapphire
// Rapids, 2026-11-27). The order changes no sum: each output is still one chain over k.
//
// With `silu` the weight is a gate_up projection (gate outputs [0, N / 2), up [N / 2, N), N / 2 a whole
// number of panels) and y is silu(gate) * up [M, N / 2]: gate panel p and up panel p + N / 64 run together
// and their sums go through `silu` from the stack, so the [M, N] projection is never written nor read back.
static void gemv_bf16_tiles(const float* x, int64_t M, int64_t K, const uint16_t* wp, int64_t panels, int64_t K2,
                            int64_t N, float* y, SiluColsFn silu) {
  const TileRows t = tile_rows(x, M, K, K2);
  const int64_t prefetch = tile_prefetch_bytes.load(std::memory_order_relaxed);
  const int64_t whole = K2 / kTilePairs * kTilePairs, tail_size = kTilePairs * 2 * kGemvLanes;
  const int64_t width = silu ? 2 : 1, steps = panels / width, I = N / 2;  // panels a step runs
  const int64_t block = std::max<int64_t>(1, kTilePanelBytes / (width * t.K2p * 4 * kGemvLanes));
  // panels split across threads, never k; tiles are per thread, so each thread configures its own
  at::parallel_for(0, steps, 1, [&](int64_t begin, int64_t end) {
    amx_configure_bf16();
    std::vector<uint16_t> tails(whole < K2 ? width * block * tail_size : 0, 0);  // [step in block][gate, up]
    alignas(64) float out[2][2 * kTileRows * kGemvLanes];
    auto tail_of = [&](int64_t i, int64_t half) {
      return tails.empty() ? nullptr : tails.data() + (i * width + half) * tail_size;
    };
    for (int64_t p0 = begin; p0 < end; p0 += block) {
      const int64_t p1 = std::min(end, p0 + block);
      for (int64_t p = p0; p < p1 && !tails.empty(); ++p)
        for (int64_t half = 0; half < width; ++half)
          std::memcpy(tail_of(p - p0, half), wp + ((p + half * steps) * K2 + whole) * 2 * kGemvLanes,
                      (K2 - whole) * 2 * kGemvLanes * sizeof(uint16_t));
      for (int64_t m = 0; m < M; m += amx_pass_rows(m, M)) {
        const int64_t rows = std::min<int64_t>(amx_pass_rows(m, M), M - m);
        for (int64_t p = p0; p < p1; ++p) {
          const uint16_t* panel = wp + p * K2 * 2 * kGemvLanes;
          if (silu) {
            amx_rows(t, m, M, panel, K2, tail_of(p - p0, 0), out[0], kGemvLanes, prefetch);
            amx_rows(t, m, M, panel + steps * K2 * 2 * kGemvLanes, K2, tail_of(p - p0, 1), out[1], kGemvLanes,
                     prefetch);
            for (int64_t r = 0; r < rows; ++r)
              silu(out[0] + r * kGemvLanes, out[1] + r * kGemvLanes, y + (m + r) * I + p * kGemvLanes,
                   p * kGemvLanes, kGemvLanes, I);
            continue;
          }
          const int64_t ncols = std::min(kGemvLanes, N - p * kGemvLanes);
          if (rows == 2 * kTileRows && ncols == kGemvLanes) {  // whole tiles: stored in place
            amx_rows(t, m, M, panel, K2, tail_of(p - p0, 0), y + m * N + p * kGemvLanes, N, prefetch);
            continue;
          }
          amx_rows(t, m, M, panel, K2, tail_of(p - p0, 0), out[0], kGemvLanes, prefetch);
          for (int64_t r = 0; r < rows; ++r)
            std::memcpy(y + (m + r) * N + p * kGemvLanes, out[0] + r * kGemvLanes, ncols * sizeof(float));
        }
      }
    }
    _tile_release();
  });
}
#endif

static void check_gemv_bf16(const torch::Tensor& x, const torch::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "gemv_bf16: contiguous float32 x");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.size(2) == kGemvLanes &&
              packed.size(3) == 2 && packed.size(1) == (x.size(1) + 1) / 2 && packed.is_contiguous(),
              "gemv_bf16: weight not packed by gemv_bf16_pack for this input width");
  const int64_t panels = packed.size(0);
  TORCH_CHECK(N > (panels - 1) * kGemvLanes && N <= panels * kGemvLanes,
              "gemv_bf16: out_features does not match the weight");
}

// y = x @ W.T [M, N]; with `silu` the weight is a gate_up projection (gate outputs [0, N / 2), up [N / 2, N),
// N / 2 a whole number of panels) and y is silu(gate) * up [M, N / 2], silu_mul's bits: the [M, N]
// projection is never written (the tiles' path above, or the passes below).
torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor packed, int64_t out_features, SiluColsFn silu) {
  check_gemv_bf16(x, packed, out_features);
  TORCH_CHECK(!silu || out_features % (2 * kGemvLanes) == 0, "gemv_bf16 with silu: gate and up of whole panels");
  const int64_t M = x.size(0), K = x.size(1), K2 = packed.size(1), panels = packed.size(0), N = out_features;
  auto y = torch::empty({M, silu ? N / 2 : N}, x.options());
  const float* xp = x.data_ptr<float>();
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
#if BATON_ISA >= BATON_ISA_AMX
  gemv_bf16_tiles(xp, M, K, wp, panels, K2, N, yp, silu);
#else
  std::vector<uint32_t> pairs;
#if BATON_ISA >= BATON_ISA_AVX512_BF16
  pairs.resize(M * K2);
  bf16_row_pairs(xp, M, K, K2, K2, pairs.data());
  const int64_t ldx = K2;
#else
  const int64_t ldx = K;
#endif
  const uint32_t* xq = pairs.empty() ? nullptr : pairs.data();
  constexpr int64_t R = kBf16RowsPerPass;
  // A decode batch passes each panel several times and only the first pass reads it from DRAM: the later
  // passes prefetch the thread's next panel into L2, each its share, as w8a8_impl.h's do
  // (bench/next_panel_prefetch.py)
  const int64_t panel_elems = K2 * 2 * kGemvLanes, passes = (M + R - 1) / R;
  const bool prefetch_next = M <= kBf16NextPrefetchMaxRows && passes > 1 &&
                             bf16_next_prefetch.load(std::memory_order_relaxed);
  const int64_t width = silu ? 2 : 1, steps = panels / width;  // panels a step runs (gated_rows.h)
  // panels split across threads, never k: each output's sum is the same whatever the threads and rows; a
  // thread done with its steps takes the others' last (steal_for.h)
  parallel_steal_steps(steps, 4, [&](int64_t p, int64_t after) {
    alignas(64) float out[2][R * kGemvLanes];
    // rows [m, m + rest) against panel q (gate or up of step p with silu), into dst
    auto pass = [&](int64_t q, int64_t m, int64_t rest, float* dst, int64_t ldd, int64_t ncols) {
      const uint16_t* panel = wp + q * panel_elems;
      const uint16_t* following = prefetch_next && after >= 0 ? panel + (after - p) * panel_elems : nullptr;
      const PanelPrefetch next = next_panel_share(following, panel_elems * 2, m / R, passes, kBf16PrefetchMaxLines);
      bf16_pass<R>(rest, xp + m * K, xq ? xq + m * K2 : nullptr, ldx, panel, K2, K, dst, ldd, ncols, next);
    };
    gated_rows<R, kGemvLanes>(0, M, p, steps, N, yp, silu, out, pass);
  });
#endif
  return y;
}
