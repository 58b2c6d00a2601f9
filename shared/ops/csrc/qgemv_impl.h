// The quantized GEMV's loops, compiled once per instruction-set level (isa_variants.h; contract in
// qgemv_cpu.cpp, layout in qgemv_layout.h). From avx512_bf16 up (which has AVX512-VNNI) each block is 8
// vpdpbusd per row for 16 outputs; below it plain integer loops the compiler vectorises. The integer sums are
// exact either way, so every level gives the same int32 block sums; the fp32 block sums are added in the
// same order too.

#if BATON_ISA >= BATON_ISA_AVX512_BF16
// The block's codes as 8 vpdpbusd operands (each: 16 lanes x 4 u8 codes)
template <int BITS>
static inline void q_codes_avx512(const uint8_t* blk, __m512i (&w)[kQQuads]) {
  if constexpr (BITS == 4) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int q = 0; q < kQQuads; ++q) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + q * 32));
      const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
      w[q] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
  } else {
    for (int q = 0; q < kQQuads; ++q) w[q] = _mm512_loadu_si512(blk + q * 64);
  }
}

template <int MR, int BITS>
static void q_panel_rows(const QRows& x, const uint8_t* panel, int64_t nblocks, float* y, int64_t ldy,
                         int64_t ncols) {
  constexpr int64_t code_bytes = q_code_bytes(BITS), block_bytes = q_block_bytes(BITS);
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* blk = panel + b * block_bytes;
    __m512i w[kQQuads];
    q_codes_avx512<BITS>(blk, w);
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + code_bytes)));
    const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + code_bytes + 32)));
    for (int m = 0; m < MR; ++m) {
      const int32_t* xq = reinterpret_cast<const int32_t*>(x.codes + m * x.ld_codes + b * kQBlock);
      __m512i s = _mm512_setzero_si512();
      for (int q = 0; q < kQQuads; ++q) s = _mm512_dpbusd_epi32(s, w[q], _mm512_set1_epi32(xq[q]));
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(x.scales[m * x.ld_blocks + b]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[m]);
      acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.sums[m * x.ld_blocks + b]), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    float out[kQLanes];
    _mm512_storeu_ps(out, acc[m]);
    for (int64_t l = 0; l < ncols; ++l) y[m * ldy + l] = out[l];
  }
}
#else
template <int MR, int BITS>
static void q_panel_rows(const QRows& x, const uint8_t* panel, int64_t nblocks, float* y, int64_t ldy,
                         int64_t ncols) {
  constexpr int64_t code_bytes = q_code_bytes(BITS), block_bytes = q_block_bytes(BITS);
  float acc[MR][kQLanes] = {};
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* blk = panel + b * block_bytes;
    // the block's codes by (lane, input): c[l][k]
    uint8_t c[kQLanes][kQBlock];
    for (int q = 0; q < kQQuads; ++q)
      for (int v = 0; v < 4 * kQLanes; ++v) {
        const uint8_t code = BITS == 4 ? (v < 32 ? blk[q * 32 + v] & 0x0f : blk[q * 32 + v - 32] >> 4)
                                       : blk[q * 64 + v];
        c[v / 4][q * 4 + v % 4] = code;
      }
    const auto* half = reinterpret_cast<const uint16_t*>(blk + code_bytes);
    float dw[kQLanes], mw[kQLanes];
    for (int l = 0; l < kQLanes; ++l) {
      dw[l] = half_to_float(half[l]);
      mw[l] = half_to_float(half[kQLanes + l]);
    }
    for (int m = 0; m < MR; ++m) {
      const int8_t* xq = x.codes + m * x.ld_codes + b * kQBlock;
      const float xd = x.scales[m * x.ld_blocks + b], xs = x.sums[m * x.ld_blocks + b];
      for (int l = 0; l < kQLanes; ++l) {
        int32_t s = 0;
        for (int k = 0; k < kQBlock; ++k) s += static_cast<int32_t>(c[l][k]) * xq[k];
        // the wide path's two FMAs, in its order
        acc[m][l] = std::fma(static_cast<float>(s), dw[l] * xd, acc[m][l]);
        acc[m][l] = std::fma(mw[l], xs, acc[m][l]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int64_t l = 0; l < ncols; ++l) y[m * ldy + l] = acc[m][l];
}
#endif

template <int R, int BITS>
static inline void q_tail_rows(int64_t rest, const QRows& x, const uint8_t* panel, int64_t nblocks, float* y,
                               int64_t ldy, int64_t ncols) {
  if constexpr (R > 0) {
    if (rest == R) return q_panel_rows<R, BITS>(x, panel, nblocks, y, ldy, ncols);
    q_tail_rows<R - 1, BITS>(rest, x, panel, nblocks, y, ldy, ncols);
  }
}

constexpr int kQRowsPerPass = BATON_ISA >= BATON_ISA_AVX512_BF16 ? 8 : 2;

template <int BITS>
static void qgemv_t(const QRows& x, int64_t M, const uint8_t* wp, int64_t panels, int64_t nblocks, int64_t N,
                    float* yp) {
  const int64_t panel_bytes = nblocks * q_block_bytes(BITS);
  at::parallel_for(0, panels, 4, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* panel = wp + p * panel_bytes;
      const int64_t ncols = std::min(kQLanes, N - p * kQLanes);
      int64_t m = 0;
      for (; m + kQRowsPerPass <= M; m += kQRowsPerPass)
        q_panel_rows<kQRowsPerPass, BITS>(x.offset(m), panel, nblocks, yp + m * N + p * kQLanes, N, ncols);
      q_tail_rows<kQRowsPerPass - 1, BITS>(M - m, x.offset(m), panel, nblocks, yp + m * N + p * kQLanes, N, ncols);
    }
  });
}

void qgemv_rows(const QRows& x, int64_t M, const uint8_t* wp, int64_t panels, int64_t nblocks, int64_t N,
                int64_t bits, float* yp) {
  if (bits == 4) qgemv_t<4>(x, M, wp, panels, nblocks, N, yp);
  else qgemv_t<8>(x, M, wp, panels, nblocks, N, yp);
}
