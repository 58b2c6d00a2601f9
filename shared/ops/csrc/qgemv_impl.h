// The quantized GEMV's loops, compiled once per instruction-set level (isa_variants.h; contract in
// qgemv_cpu.cpp, layouts in qgemv_layout.h). Every level computes the same int32 sums per block (or Q6_K
// half-block) and adds them into fp32 with the same operations in the same order, so every level gives the
// same bits:
//   avx512_bf16 and up  a quad is one vpdpbusd (AVX512-VNNI) for 16 outputs
//   avx2, avx512        a quad is vpmaddubsw + vpmaddwd per 8 outputs (codes of 8 bits split into nibbles, so
//                       no u8 x s8 pair sum saturates int16)
//   portable            integer loops over the codes as q_code_get reads them
// A unit's per-lane scales come first (fp32, exact: Q4_K's d * sc and dmin * mn are products of a fp16 and a
// 6-bit integer), then each row's block sums and its FMAs.

#if BATON_ISA >= BATON_ISA_AVX512_BF16
// 16 lanes as one register: w[q] holds quad q's 64 codes, byte v = value v
template <int BITS>
static inline void q_unpack(const uint8_t* codes, __m512i (&w)[kQQuads]) {
  const __m256i low = _mm256_set1_epi8(0x0f);
  for (int q = 0; q < kQQuads; ++q) {
    const uint8_t* quad = codes + q * q_quad_bytes(BITS);
    if constexpr (BITS == 8) {
      w[q] = _mm512_loadu_si512(quad);
      continue;
    }
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad));
    const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    w[q] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    if constexpr (BITS == 5) {
      uint64_t bits;
      std::memcpy(&bits, quad + 32, 8);
      w[q] = _mm512_or_si512(w[q], _mm512_maskz_mov_epi8(bits, _mm512_set1_epi8(0x10)));
    } else if constexpr (BITS == 6) {
      // byte v % 16 of the pairs, shifted by 2 (v / 16): one 128-bit copy per 16 values
      const __m512i pairs = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(quad + 32)));
      const __m512i shifts = _mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0);
      const __m512i two = _mm512_and_si512(_mm512_srlv_epi32(pairs, shifts), _mm512_set1_epi8(0x03));
      w[q] = _mm512_or_si512(w[q], _mm512_slli_epi32(two, 4));
    }
  }
}

static inline __m512i q_dot(const __m512i (&w)[kQQuads], const int8_t* xq, int q0, int q1) {
  const auto* x4 = reinterpret_cast<const int32_t*>(xq);
  __m512i s = _mm512_setzero_si512();
  for (int q = q0; q < q1; ++q) s = _mm512_dpbusd_epi32(s, w[q], _mm512_set1_epi32(x4[q]));
  return s;
}

static inline __m512 q_half_ps(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
static inline __m512 q_u8_ps(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// One block b of MR rows: acc += (d_w d_x) * sum + m_w s_x, per lane
template <int MR, int BITS>
static inline void q_block_rows(const QRows& x, int64_t b, const uint8_t* codes, __m512 dw, __m512 mw,
                                __m512 (&acc)[MR]) {
  __m512i w[kQQuads];
  q_unpack<BITS>(codes, w);
  for (int m = 0; m < MR; ++m) {
    const __m512i s = q_dot(w, x.codes + m * x.ld_codes + b * kQBlock, 0, kQQuads);
    const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(x.scales[m * x.ld_blocks + b]));
    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[m]);
    acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.sums[m * x.ld_blocks + b]), acc[m]);
  }
}

// One block b of Q6_K for MR rows: per half h, (sum - 32 sum_x) * sc_h in int32, then acc += (d d_x) * that
template <int MR>
static inline void q6k_block_rows(const QRows& x, int64_t b, const uint8_t* codes, const uint8_t* sc, __m512 d,
                                  __m512 (&acc)[MR]) {
  __m512i w[kQQuads];
  q_unpack<6>(codes, w);
  const __m512i sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
  const __m512i sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + kQLanes)));
  for (int m = 0; m < MR; ++m) {
    const int8_t* xq = x.codes + m * x.ld_codes + b * kQBlock;
    const int32_t* s16 = x.sums16 + m * 2 * x.ld_blocks + 2 * b;
    const __m512i h0 = _mm512_sub_epi32(q_dot(w, xq, 0, kQQuads / 2), _mm512_set1_epi32(32 * s16[0]));
    const __m512i h1 = _mm512_sub_epi32(q_dot(w, xq, kQQuads / 2, kQQuads), _mm512_set1_epi32(32 * s16[1]));
    const __m512i s = _mm512_add_epi32(_mm512_mullo_epi32(h0, sc0), _mm512_mullo_epi32(h1, sc1));
    const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(x.scales[m * x.ld_blocks + b]));
    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[m]);
  }
}

template <int MR, int F>
static void q_panel_rows(const QRows& x, const uint8_t* panel, int64_t units, float* y, int64_t ldy,
                         int64_t ncols) {
  constexpr int BITS = F == kB4 || F == kQ4K ? 4 : F == kB5 ? 5 : F == kQ6K ? 6 : 8;
  constexpr int64_t unit_bytes = q_unit_bytes(static_cast<QFormat>(F)), cb = q_code_bytes(BITS);
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* unit = panel + u * unit_bytes;
    if constexpr (F <= kB8) {
      q_block_rows<MR, BITS>(x, u, unit, q_half_ps(unit + cb), q_half_ps(unit + cb + 2 * kQLanes), acc);
    } else if constexpr (F == kQ4K) {
      const uint8_t* tail = unit + kQSubBlocks * cb;
      const __m512 d = q_half_ps(tail + 2 * kQSubBlocks * kQLanes);
      const __m512 dmin = q_half_ps(tail + 2 * kQSubBlocks * kQLanes + 2 * kQLanes);
      for (int64_t j = 0; j < kQSubBlocks; ++j) {
        const __m512 dw = _mm512_mul_ps(d, q_u8_ps(tail + j * kQLanes));
        const __m512 mw = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, q_u8_ps(tail + (kQSubBlocks + j) * kQLanes)));
        q_block_rows<MR, 4>(x, u * kQSubBlocks + j, unit + j * cb, dw, mw, acc);
      }
    } else {
      const uint8_t* tail = unit + kQSubBlocks * cb;
      const __m512 d = q_half_ps(tail + 2 * kQSubBlocks * kQLanes);
      for (int64_t j = 0; j < kQSubBlocks; ++j)
        q6k_block_rows<MR>(x, u * kQSubBlocks + j, unit + j * cb, tail + 2 * j * kQLanes, d, acc);
    }
  }
  for (int m = 0; m < MR; ++m) {
    float out[kQLanes];
    _mm512_storeu_ps(out, acc[m]);
    for (int64_t l = 0; l < ncols; ++l) y[m * ldy + l] = out[l];
  }
}
#elif BATON_ISA >= BATON_ISA_AVX2
// Eight lanes (half h of the panel) as one register: w[q] holds lanes 8h .. 8h + 7 of quad q
template <int BITS>
static inline void q_unpack(const uint8_t* codes, int h, __m256i (&w)[kQQuads]) {
  const __m256i low = _mm256_set1_epi8(0x0f);
  for (int q = 0; q < kQQuads; ++q) {
    const uint8_t* quad = codes + q * q_quad_bytes(BITS);
    if constexpr (BITS == 8) {
      w[q] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad + 32 * h));
      continue;
    }
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad));
    w[q] = _mm256_and_si256(h == 0 ? raw : _mm256_srli_epi16(raw, 4), low);
    if constexpr (BITS == 5) {
      // bit i of the half's u32 -> 0x10 in byte i: each byte picks its byte of the u32, then its bit
      uint32_t bits;
      std::memcpy(&bits, quad + 32 + 4 * h, 4);
      const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                                            3, 3, 3, 3, 3, 3, 3, 3);
      const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
      const __m256i set = _mm256_cmpeq_epi8(
          _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), pick), bit), bit);
      w[q] = _mm256_or_si256(w[q], _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
    } else if constexpr (BITS == 6) {
      const __m256i pairs = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(quad + 32)));
      const __m256i shifts = h == 0 ? _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2) : _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6);
      const __m256i two = _mm256_and_si256(_mm256_srlv_epi32(pairs, shifts), _mm256_set1_epi8(0x03));
      w[q] = _mm256_or_si256(w[q], _mm256_slli_epi32(two, 4));
    }
  }
}

// u8 codes (< 64) x s8 activations: pair sums fit int16 (2 * 63 * 128 < 32768), then pairs of those to int32
template <int BITS>
static inline __m256i q_dot(const __m256i (&w)[kQQuads], const int8_t* xq, int q0, int q1) {
  const auto* x4 = reinterpret_cast<const int32_t*>(xq);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i s = _mm256_setzero_si256();
  for (int q = q0; q < q1; ++q) {
    const __m256i xv = _mm256_set1_epi32(x4[q]);
    if constexpr (BITS == 8) {  // 255 * 128 * 2 would saturate: the codes' nibbles, the high one weighted 16
      const __m256i low = _mm256_set1_epi8(0x0f);
      const __m256i lo = _mm256_and_si256(w[q], low), hi = _mm256_and_si256(_mm256_srli_epi16(w[q], 4), low);
      s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xv), ones));
      s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xv), _mm256_set1_epi16(16)));
    } else {
      s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(w[q], xv), ones));
    }
  }
  return s;
}

static inline __m256 q_half_ps(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline __m256 q_u8_ps(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

template <int MR, int F>
static void q_panel_rows(const QRows& x, const uint8_t* panel, int64_t units, float* y, int64_t ldy,
                         int64_t ncols) {
  constexpr int BITS = F == kB4 || F == kQ4K ? 4 : F == kB5 ? 5 : F == kQ6K ? 6 : 8;
  constexpr int64_t unit_bytes = q_unit_bytes(static_cast<QFormat>(F)), cb = q_code_bytes(BITS);
  constexpr int64_t blocks = F <= kB8 ? 1 : kQSubBlocks;
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* unit = panel + u * unit_bytes;
    const uint8_t* tail = unit + blocks * cb;
    for (int h = 0; h < 2; ++h) {
      const int64_t lane = 8 * h;
      for (int64_t j = 0; j < blocks; ++j) {
        const int64_t b = u * blocks + j;
        __m256i w[kQQuads];
        q_unpack<BITS>(unit + j * cb, h, w);
        __m256 dw, mw = _mm256_setzero_ps();
        if constexpr (F <= kB8) {
          dw = q_half_ps(tail + 2 * lane);
          mw = q_half_ps(tail + 2 * (kQLanes + lane));
        } else if constexpr (F == kQ4K) {
          dw = _mm256_mul_ps(q_half_ps(tail + 2 * kQSubBlocks * kQLanes + 2 * lane), q_u8_ps(tail + j * kQLanes + lane));
          mw = _mm256_sub_ps(_mm256_setzero_ps(),
                             _mm256_mul_ps(q_half_ps(tail + 2 * kQSubBlocks * kQLanes + 2 * (kQLanes + lane)),
                                           q_u8_ps(tail + (kQSubBlocks + j) * kQLanes + lane)));
        } else {
          dw = q_half_ps(tail + 2 * kQSubBlocks * kQLanes + 2 * lane);
        }
        // Q6_K's int8 scales of the block's two halves
        const uint8_t* sc = tail + 2 * j * kQLanes + lane;
        const __m256i sc0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)));
        const __m256i sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + kQLanes)));
        for (int m = 0; m < MR; ++m) {
          const int8_t* xq = x.codes + m * x.ld_codes + b * kQBlock;
          __m256i s;
          if constexpr (F == kQ6K) {
            const int32_t* s16 = x.sums16 + m * 2 * x.ld_blocks + 2 * b;
            const __m256i h0 = _mm256_sub_epi32(q_dot<6>(w, xq, 0, kQQuads / 2), _mm256_set1_epi32(32 * s16[0]));
            const __m256i h1 = _mm256_sub_epi32(q_dot<6>(w, xq, kQQuads / 2, kQQuads), _mm256_set1_epi32(32 * s16[1]));
            s = _mm256_add_epi32(_mm256_mullo_epi32(h0, sc0), _mm256_mullo_epi32(h1, sc1));
          } else {
            s = q_dot<BITS>(w, xq, 0, kQQuads);
          }
          const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(x.scales[m * x.ld_blocks + b]));
          acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[m][h]);
          if constexpr (F != kQ6K) acc[m][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.sums[m * x.ld_blocks + b]), acc[m][h]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    float out[kQLanes];
    _mm256_storeu_ps(out, acc[m][0]);
    _mm256_storeu_ps(out + 8, acc[m][1]);
    for (int64_t l = 0; l < ncols; ++l) y[m * ldy + l] = out[l];
  }
}
#else
// A unit's block j at lane l: its int32 sum with the row's block, and its scale and offset (fp32)
template <int F>
static void q_panel_rows_portable(int MR, const QRows& x, const uint8_t* panel, int64_t units, float* y,
                                  int64_t ldy, int64_t ncols) {
  constexpr int BITS = F == kB4 || F == kQ4K ? 4 : F == kB5 ? 5 : F == kQ6K ? 6 : 8;
  constexpr int64_t unit_bytes = q_unit_bytes(static_cast<QFormat>(F)), cb = q_code_bytes(BITS);
  constexpr int64_t blocks = F <= kB8 ? 1 : kQSubBlocks;
  float acc[8][kQLanes] = {};
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* unit = panel + u * unit_bytes;
    const uint8_t* tail = unit + blocks * cb;
    const auto* half = reinterpret_cast<const uint16_t*>(F <= kB8 ? tail : tail + 2 * kQSubBlocks * kQLanes);
    for (int64_t j = 0; j < blocks; ++j) {
      const int64_t b = u * blocks + j;
      for (int l = 0; l < kQLanes; ++l) {
        float dw = half_to_float(half[l]), mw = 0.f;
        if constexpr (F <= kB8) mw = half_to_float(half[kQLanes + l]);
        if constexpr (F == kQ4K) {
          dw = dw * static_cast<float>(tail[j * kQLanes + l]);
          mw = 0.f - half_to_float(half[kQLanes + l]) * static_cast<float>(tail[(kQSubBlocks + j) * kQLanes + l]);
        }
        uint8_t c[kQBlock];
        for (int k = 0; k < kQBlock; ++k) c[k] = q_code_get(unit + j * cb, BITS, l, k);
        for (int m = 0; m < MR; ++m) {
          const int8_t* xq = x.codes + m * x.ld_codes + b * kQBlock;
          int32_t s = 0;
          if constexpr (F == kQ6K) {
            const int32_t* s16 = x.sums16 + m * 2 * x.ld_blocks + 2 * b;
            for (int h = 0; h < 2; ++h) {
              int32_t t = 0;
              for (int k = 16 * h; k < 16 * h + 16; ++k) t += static_cast<int32_t>(c[k]) * xq[k];
              s += (t - 32 * s16[h]) * static_cast<int8_t>(tail[(2 * j + h) * kQLanes + l]);
            }
          } else {
            for (int k = 0; k < kQBlock; ++k) s += static_cast<int32_t>(c[k]) * xq[k];
          }
          // the wide paths' FMAs, in their order
          acc[m][l] = std::fma(static_cast<float>(s), dw * x.scales[m * x.ld_blocks + b], acc[m][l]);
          if constexpr (F != kQ6K) acc[m][l] = std::fma(mw, x.sums[m * x.ld_blocks + b], acc[m][l]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int64_t l = 0; l < ncols; ++l) y[m * ldy + l] = acc[m][l];
}

template <int MR, int F>
static void q_panel_rows(const QRows& x, const uint8_t* panel, int64_t units, float* y, int64_t ldy,
                         int64_t ncols) {
  q_panel_rows_portable<F>(MR, x, panel, units, y, ldy, ncols);
}
#endif

template <int R, int F>
static inline void q_tail_rows(int64_t rest, const QRows& x, const uint8_t* panel, int64_t units, float* y,
                               int64_t ldy, int64_t ncols) {
  if constexpr (R > 0) {
    if (rest == R) return q_panel_rows<R, F>(x, panel, units, y, ldy, ncols);
    q_tail_rows<R - 1, F>(rest, x, panel, units, y, ldy, ncols);
  }
}

// rows whose sums stay in registers beside a block's codes (16 vector registers below AVX-512, 32 from it)
constexpr int kQRowsPerPass = BATON_ISA >= BATON_ISA_AVX512_BF16 ? 8 : BATON_ISA >= BATON_ISA_AVX512 ? 4 : 2;

template <int F>
static void qgemv_t(const QRows& x, int64_t M, const uint8_t* wp, int64_t panels, int64_t units, int64_t N,
                    float* yp) {
  const int64_t panel_bytes = units * q_unit_bytes(static_cast<QFormat>(F));
  // panels split across threads; a thread done with its own takes the others' last (steal_for.h)
  parallel_steal_steps(panels, 4, [&](int64_t p, int64_t) {
    const uint8_t* panel = wp + p * panel_bytes;
    const int64_t ncols = std::min(kQLanes, N - p * kQLanes);
    int64_t m = 0;
    for (; m + kQRowsPerPass <= M; m += kQRowsPerPass)
      q_panel_rows<kQRowsPerPass, F>(x.offset(m), panel, units, yp + m * N + p * kQLanes, N, ncols);
    q_tail_rows<kQRowsPerPass - 1, F>(M - m, x.offset(m), panel, units, yp + m * N + p * kQLanes, N, ncols);
  });
}

void qgemv_rows(const QRows& x, int64_t M, const uint8_t* wp, int64_t panels, int64_t units, int64_t N,
                int64_t format, float* yp) {
  switch (format) {
    case kB4: return qgemv_t<kB4>(x, M, wp, panels, units, N, yp);
    case kB5: return qgemv_t<kB5>(x, M, wp, panels, units, N, yp);
    case kB8: return qgemv_t<kB8>(x, M, wp, panels, units, N, yp);
    case kQ4K: return qgemv_t<kQ4K>(x, M, wp, panels, units, N, yp);
    default: return qgemv_t<kQ6K>(x, M, wp, panels, units, N, yp);
  }
}
