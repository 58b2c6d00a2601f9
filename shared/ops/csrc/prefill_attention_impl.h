// The prefill attention's loops, compiled once per instruction-set level (isa_variants.h; the contract is in
// prefill_attention_cpu.cpp). From avx512 up the scores, the softmax and the values' sums of a tile are
// intrinsics (a tile's scores are two registers; eight rows' scores are independent FMA chains, which
// the compiler's version of the plain loop left as one chain through memory, 2.4 ms against 0.9 a chunk);
// at avx2 the same on 8 lanes, two rows at a time; at portable, plain loops over the same tiles.

#include "exp_simd.h"  // inside the level's namespace: exp_nonpositive(16)
#include "simd_dot.h"  // to_f32: a bf16 or fp8 cache's bits widened
#include "reduce8.h"   // reduce_max8 and reduce_add8 for the avx2 softmax
#include "widen16.h"   // widen16: 16 of them at once from avx512 up
#include "bf16_pairs.h"  // load32_bf16 and the scales of the vdpbf16ps passes, from avx512_bf16 up

// A tile of 32 keys, not 16: a row's softmax (two reductions, an exp, the rescale of its sums) runs once per
// tile, and its latency, not the FMAs, bounded the 16-key tiles; 32-key tiles and 32 positions a job took
// 0.74x the time of 16 and 16 (256-token prompt, 512 after 1,536, Sapphire Rapids, 2026-11-27)
constexpr int kTq = 32;  // query positions per job (every query head of one KV head: group * kTq rows)
constexpr int kTk = 32;  // keys per tile
constexpr int kVecs = kTk / 16;  // a row's scores of one tile, 16 to a register

// Rows whose scores one pass computes: their accumulators are independent FMA chains
constexpr int kRowsPerPass = 8;
// The widest head a key row is widened for on the stack (Gemma 4's global layers: 512)
constexpr int64_t kMaxWidenedDim = 512;

// sc[r][j] = q_r . k_j for rows r < rb (q: rb rows of D, scaled), keys transposed in kt [D][kTk]
static inline void tile_scores(const float* q, int64_t D, const float* kt, int rb, float (*sc)[kTk]) {
#if BATON_ISA >= BATON_ISA_AVX512
  __m512 s[kRowsPerPass][kVecs];
  for (int r = 0; r < kRowsPerPass; ++r)
    for (int v = 0; v < kVecs; ++v) s[r][v] = _mm512_setzero_ps();
  if (rb == kRowsPerPass) {
    for (int64_t d = 0; d < D; ++d) {
      __m512 kd[kVecs];
      for (int v = 0; v < kVecs; ++v) kd[v] = _mm512_loadu_ps(kt + d * kTk + 16 * v);
      for (int r = 0; r < kRowsPerPass; ++r) {
        const __m512 x = _mm512_set1_ps(q[r * D + d]);
        for (int v = 0; v < kVecs; ++v) s[r][v] = _mm512_fmadd_ps(x, kd[v], s[r][v]);
      }
    }
  } else {
    for (int64_t d = 0; d < D; ++d) {
      __m512 kd[kVecs];
      for (int v = 0; v < kVecs; ++v) kd[v] = _mm512_loadu_ps(kt + d * kTk + 16 * v);
      for (int r = 0; r < rb; ++r) {
        const __m512 x = _mm512_set1_ps(q[r * D + d]);
        for (int v = 0; v < kVecs; ++v) s[r][v] = _mm512_fmadd_ps(x, kd[v], s[r][v]);
      }
    }
  }
  for (int r = 0; r < rb; ++r)
    for (int v = 0; v < kVecs; ++v) _mm512_storeu_ps(sc[r] + 16 * v, s[r][v]);
#elif BATON_ISA == BATON_ISA_AVX2
  // two rows at a time: their 2 x 4 sums, the tile's four key vectors and a broadcast fit the 16 ymm (the
  // plain loop below kept each row's sums in memory, one chain through it)
  constexpr int kV8 = kTk / 8;
  for (int r = 0; r < rb; r += 2) {
    const bool pair = r + 1 < rb;
    const float* q1 = q + (pair ? r + 1 : r) * D;
    __m256 s0[kV8], s1[kV8];
    for (int v = 0; v < kV8; ++v) s0[v] = s1[v] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const __m256 x0 = _mm256_set1_ps(q[r * D + d]), x1 = _mm256_set1_ps(q1[d]);
      for (int v = 0; v < kV8; ++v) {
        const __m256 kd = _mm256_loadu_ps(kt + d * kTk + 8 * v);
        s0[v] = _mm256_fmadd_ps(x0, kd, s0[v]);
        s1[v] = _mm256_fmadd_ps(x1, kd, s1[v]);
      }
    }
    for (int v = 0; v < kV8; ++v) {
      _mm256_storeu_ps(sc[r] + 8 * v, s0[v]);
      if (pair) _mm256_storeu_ps(sc[r + 1] + 8 * v, s1[v]);
    }
  }
#else
  for (int r = 0; r < rb; ++r) {
    float* s = sc[r];
    for (int j = 0; j < kTk; ++j) s[j] = 0.f;
    for (int64_t d = 0; d < D; ++d) {
      const float x = q[r * D + d];
      const float* kd = kt + d * kTk;
#pragma omp simd
      for (int j = 0; j < kTk; ++j) s[j] += x * kd[j];
    }
  }
#endif
}

// The tile's scores s[j] of keys j in [j_begin, j_end) become exp(s[j] - m_new), the others 0, where m_new is
// the larger of m_old and their max; returns m_new, their sum in *sum
static inline float softmax_tile(float* s, int64_t j_begin, int64_t j_end, float m_old, float* sum) {
#if BATON_ISA >= BATON_ISA_AVX512
  __m512 sv[kVecs];
  __mmask16 valid[kVecs];
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int v = 0; v < kVecs; ++v) {
    const int64_t b = std::clamp<int64_t>(j_begin - 16 * v, 0, 16), e = std::clamp<int64_t>(j_end - 16 * v, 0, 16);
    valid[v] = static_cast<__mmask16>(((1u << e) - 1) & ~((1u << b) - 1));
    sv[v] = _mm512_mask_blend_ps(valid[v], _mm512_set1_ps(-INFINITY), _mm512_loadu_ps(s + 16 * v));
    mx = _mm512_max_ps(mx, sv[v]);
  }
  const float m_new = std::max(m_old, _mm512_reduce_max_ps(mx));
  const __m512 mn = _mm512_set1_ps(m_new);
  __m512 total = _mm512_setzero_ps();
  for (int v = 0; v < kVecs; ++v) {
    const __m512 e = _mm512_maskz_mov_ps(valid[v], exp_nonpositive16(_mm512_sub_ps(sv[v], mn)));
    _mm512_storeu_ps(s + 16 * v, e);
    total = _mm512_add_ps(total, e);
  }
  *sum = _mm512_reduce_add_ps(total);
  return m_new;
#elif BATON_ISA == BATON_ISA_AVX2
  // the plain loop's exps ran one at a time (its sum is a reduction the compiler keeps in order)
  constexpr int kV8 = kTk / 8;
  __m256 sv[kV8], valid[kV8];
  __m256 mx = _mm256_set1_ps(-INFINITY);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int v = 0; v < kV8; ++v) {
    const __m256i j = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * v));
    valid[v] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(j, _mm256_set1_epi32((int)j_begin - 1)),
                                                    _mm256_cmpgt_epi32(_mm256_set1_epi32((int)j_end), j)));
    sv[v] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(s + 8 * v), valid[v]);
    mx = _mm256_max_ps(mx, sv[v]);
  }
  const float m_new = std::max(m_old, reduce_max8(mx));
  const __m256 mn = _mm256_set1_ps(m_new);
  __m256 total = _mm256_setzero_ps();
  for (int v = 0; v < kV8; ++v) {
    const __m256 e = _mm256_and_ps(valid[v], exp_nonpositive8(_mm256_sub_ps(sv[v], mn)));
    _mm256_storeu_ps(s + 8 * v, e);
    total = _mm256_add_ps(total, e);
  }
  *sum = reduce_add8(total);
  return m_new;
#else
  float mx = m_old;
  for (int64_t j = j_begin; j < j_end; ++j) mx = std::max(mx, s[j]);
  float total = 0.f;
  for (int j = 0; j < kTk; ++j) {
    const float e = j >= j_begin && j < j_end ? exp_nonpositive(s[j] - mx) : 0.f;
    s[j] = e;
    total += e;
  }
  *sum = total;
  return mx;
#endif
}

// acc[d] = acc[d] * corr + sum over j < n of p[j] * vt[j][d]
static inline void tile_values(float* __restrict acc, int64_t D, float corr, const float* p, const float* vt, int n) {
#if BATON_ISA >= BATON_ISA_AVX512
  if (D % 64 == 0) {
    const __m512 c = _mm512_set1_ps(corr);
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(acc + d0), c), a1 = _mm512_mul_ps(_mm512_loadu_ps(acc + d0 + 16), c);
      __m512 a2 = _mm512_mul_ps(_mm512_loadu_ps(acc + d0 + 32), c), a3 = _mm512_mul_ps(_mm512_loadu_ps(acc + d0 + 48), c);
      for (int j = 0; j < n; ++j) {
        const __m512 w = _mm512_set1_ps(p[j]);
        const float* v = vt + j * D + d0;
        a0 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v), a0);
        a1 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 16), a1);
        a2 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 32), a2);
        a3 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 48), a3);
      }
      _mm512_storeu_ps(acc + d0, a0);
      _mm512_storeu_ps(acc + d0 + 16, a1);
      _mm512_storeu_ps(acc + d0 + 32, a2);
      _mm512_storeu_ps(acc + d0 + 48, a3);
    }
    return;
  }
#elif BATON_ISA == BATON_ISA_AVX2
  if (D % 32 == 0) {  // avx512's loop on four ymm sums of 8: a value row's 32 dims at a time, in registers
    const __m256 c = _mm256_set1_ps(corr);
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      __m256 a[4];
      for (int i = 0; i < 4; ++i) a[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + d0 + 8 * i), c);
      for (int j = 0; j < n; ++j) {
        const __m256 w = _mm256_set1_ps(p[j]);
        for (int i = 0; i < 4; ++i) a[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + j * D + d0 + 8 * i), a[i]);
      }
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(acc + d0 + 8 * i, a[i]);
    }
    return;
  }
#endif
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) acc[d] *= corr;
  for (int j = 0; j < n; ++j) {
    const float w = p[j];
    const float* __restrict vr = vt + j * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] += w * vr[d];
  }
}

// One job: query positions [i0, i1) of the heads of KV head g, online softmax over key tiles.
//   per tile: kt[d][j] (the keys transposed, widened), vt[j][d]; per row r: s = q_r . kt (kTk lanes), masked
//   to the row's causal window, m_r / l_r the running max and sum, o_r = o_r * exp(m_old - m_new) + p . vt
template <typename KV>
struct PrefillJob {
  const float* q;  // [Lq, H, D] with strides qs (token), qhs (head)
  int64_t qs, qhs;
  const KV* k;  // [Lk, Hkv, D] with strides ks, khs
  const KV* v;
  int64_t ks, khs, vs, vhs;
  float* o;  // [Lq, H, D] with strides os, ohs
  int64_t os, ohs;
  int64_t D, G, ctx, window;  // ctx = Lk - Lq: query i sits at position ctx + i
  float scale;
};

// A job covers query positions [i0, i1) of every query head of KV head g; its row r is query head
// g * G + r / nq at position i0 + r % nq (nq = i1 - i0). Row r's query:
template <typename KV>
static inline const float* row_query(const PrefillJob<KV>& jb, int64_t g, int64_t i0, int64_t nq, int64_t r) {
  return jb.q + (i0 + r % nq) * jb.qs + (g * jb.G + r / nq) * jb.qhs;
}

// The job's R rows of sums o, each times unit / its softmax sum l[r] (every row sees at least its own key),
// into the output
template <typename KV>
static inline void write_rows(const PrefillJob<KV>& jb, int64_t g, int64_t i0, int64_t nq, int64_t R,
                              const float* o, const float* l, float unit) {
  for (int64_t r = 0; r < R; ++r) {
    float* dst = jb.o + (i0 + r % nq) * jb.os + (g * jb.G + r / nq) * jb.ohs;
    const float inv = unit / l[r];
    for (int64_t d = 0; d < jb.D; ++d) dst[d] = o[r * jb.D + d] * inv;
  }
}

// The job's walk over key tiles, shared by prefill_job's fp32 and bf16 forms: for each tile of kTk keys from
// the first any of its rows sees to the last query's own, `load(t0, n)` makes the tile's n keys and values
// ready, then per pass of up to kRowsPerPass rows `scores(r0, rb, sc)` fills their scores, and each row that
// sees part of the tile takes it through the online softmax (m, l: each row's running max and sum) and
// `values(r, corr, s, n)`, its sums (o: R rows of D, zeroed here) rescaled by corr and the tile's weights added.
template <typename KV, typename Load, typename Scores, typename Values>
static inline void tile_walk(const PrefillJob<KV>& jb, int64_t i0, int64_t i1, int64_t R, float* m, float* l,
                             float* o, Load&& load, Scores&& scores, Values&& values) {
  const int64_t nq = i1 - i0;
  std::fill(m, m + R, -INFINITY);
  std::fill(l, l + R, 0.f);
  std::fill(o, o + R * jb.D, 0.f);
  const int64_t last = jb.ctx + i1 - 1;  // the last query's position: no key after it is seen
  const int64_t first = jb.window > 0 ? std::max<int64_t>(0, jb.ctx + i0 - jb.window + 1) : 0;
  for (int64_t t0 = first; t0 <= last; t0 += kTk) {
    const int64_t n = std::min<int64_t>(kTk, last + 1 - t0);
    load(t0, n);
    for (int64_t r0 = 0; r0 < R; r0 += kRowsPerPass) {
      const int rb = static_cast<int>(std::min<int64_t>(kRowsPerPass, R - r0));
      float sc[kRowsPerPass][kTk];
      scores(r0, rb, sc);
      for (int rr = 0; rr < rb; ++rr) {
        const int64_t r = r0 + rr, pos = jb.ctx + i0 + r % nq;
        const int64_t lo = jb.window > 0 ? pos - jb.window + 1 : 0;
        if (t0 > pos || t0 + kTk <= lo) continue;  // the tile lies after this query, or before its window
        // keys j of the tile this row sees: t0 + j in [lo, pos], j < n
        const int64_t j_end = std::min<int64_t>(n, pos - t0 + 1), j_begin = std::max<int64_t>(0, lo - t0);
        float* s = sc[rr];
        float sum;
        const float m_new = softmax_tile(s, j_begin, j_end, m[r], &sum);
        const float corr = exp_nonpositive(m[r] - m_new);  // 0 for the first tile (m = -inf)
        m[r] = m_new;
        l[r] = l[r] * corr + sum;
        values(r, corr, s, n);
      }
    }
  }
}

template <typename KV>
static void prefill_job(const PrefillJob<KV>& jb, int64_t g, int64_t i0, int64_t i1, std::vector<float>& buf) {
  const int64_t D = jb.D, G = jb.G, nq = i1 - i0, R = G * nq;
  buf.resize(static_cast<size_t>(D * kTk * 2 + R * (D + 2) + R * D));
  float* kt = buf.data();             // [D][kTk]
  float* vt = kt + D * kTk;           // [kTk][D]
  float* o = vt + D * kTk;            // [R][D] running outputs
  float* m = o + R * D;               // [R]
  float* l = m + R;                   // [R]
  float* qr = l + R;                  // [R][D] the rows' queries times the scale
  for (int64_t r = 0; r < R; ++r) {
    const float* src = row_query(jb, g, i0, nq, r);
    for (int64_t d = 0; d < D; ++d) qr[r * D + d] = src[d] * jb.scale;
  }
  tile_walk(
      jb, i0, i1, R, m, l, o,
      [&](int64_t t0, int64_t n) {
        for (int64_t j = 0; j < kTk; ++j) {
          if (j < n) {
            const KV* kp = jb.k + (t0 + j) * jb.ks + g * jb.khs;
            const KV* vp = jb.v + (t0 + j) * jb.vs + g * jb.vhs;
#if BATON_ISA >= BATON_ISA_AVX512
            // 16 at a time where the compiler's loop went value by value (an fp8 one through a table): the
            // keys widened into the stack, then stored transposed. int8 + fp8 KV, 8 x 256 prompts, Zen 5: the
            // chunk's attention 101.1 and 98.8 ms against 123.2 and 112.8 before (bf16 KV: 97.8, as before)
            if constexpr (!std::is_same_v<KV, float>) {
              if (D % 16 == 0 && D <= kMaxWidenedDim) {
                alignas(64) float row[kMaxWidenedDim];
                for (int64_t d = 0; d < D; d += 16) _mm512_store_ps(row + d, widen16(kp + d));
                for (int64_t d = 0; d < D; ++d) kt[d * kTk + j] = row[d];
                for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(vt + j * D + d, widen16(vp + d));
                continue;
              }
            }
#elif BATON_ISA == BATON_ISA_AVX2
            if constexpr (!std::is_same_v<KV, float>) {  // as above, 8 at a time (fp8 through F16C)
              if (D % 8 == 0 && D <= kMaxWidenedDim) {
                alignas(32) float row[kMaxWidenedDim];
                for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(row + d, widen8(kp + d));
                for (int64_t d = 0; d < D; ++d) kt[d * kTk + j] = row[d];
                for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(vt + j * D + d, widen8(vp + d));
                continue;
              }
            }
#endif
            for (int64_t d = 0; d < D; ++d) kt[d * kTk + j] = to_f32(kp[d]);
            for (int64_t d = 0; d < D; ++d) vt[j * D + d] = to_f32(vp[d]);
          } else {
            for (int64_t d = 0; d < D; ++d) kt[d * kTk + j] = 0.f;
            for (int64_t d = 0; d < D; ++d) vt[j * D + d] = 0.f;
          }
        }
      },
      [&](int64_t r0, int rb, float (*sc)[kTk]) { tile_scores(qr + r0 * D, D, kt, rb, sc); },
      [&](int64_t r, float corr, const float* s, int64_t n) {
        tile_values(o + r * D, D, corr, s, vt, static_cast<int>(n));
      });
  write_rows(jb, g, i0, nq, R, o, l, 1.f);
}

#if BATON_ISA >= BATON_ISA_AVX512_BF16
// sc[r][j] = (q_r . k_j) * unit for rows r < rb, as tile_scores, by vdpbf16ps: q2 holds each row's query as P
// bf16 pairs of adjacent dims (uint32), kt2[p][j] key j's pair p
static inline void tile_scores_bf16(const uint32_t* q2, int64_t P, const uint32_t* kt2, int rb, float unit,
                                    float (*sc)[kTk]) {
  __m512 s[kRowsPerPass][kVecs];
  for (int r = 0; r < kRowsPerPass; ++r)
    for (int v = 0; v < kVecs; ++v) s[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    __m512bh kd[kVecs];
    for (int v = 0; v < kVecs; ++v) kd[v] = (__m512bh)_mm512_loadu_si512(kt2 + p * kTk + 16 * v);
    for (int r = 0; r < kRowsPerPass; ++r)
      if (r < rb) {
        const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(q2[r * P + p]));
        for (int v = 0; v < kVecs; ++v) s[r][v] = _mm512_dpbf16_ps(s[r][v], kd[v], x);
      }
  }
  for (int r = 0; r < rb; ++r)
    for (int v = 0; v < kVecs; ++v) _mm512_storeu_ps(sc[r] + 16 * v, _mm512_mul_ps(s[r][v], _mm512_set1_ps(unit)));
}

// acc = acc * corr + sum over key pairs of (p_2i, p_2i+1) . (v_2i, v_2i+1), by vdpbf16ps: vt2 holds the tile's
// values as pairs of keys in unpack order (bf16_pairs.h), D uint32 per pair; acc's dims are in that order too.
// Two chains of sums (even and odd pairs) for each register, added at the end
static inline void tile_values_bf16(float* __restrict acc, int64_t D, float corr, const float* p, float wscale,
                                    const uint32_t* vt2, int n) {
  alignas(64) uint32_t w[kTk / 2];  // the weights as bf16 pairs, scaled
  const __m512 sc = _mm512_set1_ps(wscale);
  for (int v = 0; v < kVecs; v += 2)
    _mm512_store_si512(w + 8 * v, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(p + 16 * v + 16), sc),
                                                                _mm512_mul_ps(_mm512_loadu_ps(p + 16 * v), sc)));
  const int pairs = (n + 1) / 2;
  const __m512 c = _mm512_set1_ps(corr);
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(acc + d0), c), a1 = _mm512_mul_ps(_mm512_loadu_ps(acc + d0 + 16), c);
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    int i = 0;
    for (; i + 1 < pairs; i += 2) {
      const __m512bh w0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(w[i]));
      const __m512bh w1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(w[i + 1]));
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(vt2 + i * D + d0), w0);
      a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(vt2 + i * D + d0 + 16), w0);
      b0 = _mm512_dpbf16_ps(b0, (__m512bh)_mm512_loadu_si512(vt2 + (i + 1) * D + d0), w1);
      b1 = _mm512_dpbf16_ps(b1, (__m512bh)_mm512_loadu_si512(vt2 + (i + 1) * D + d0 + 16), w1);
    }
    if (i < pairs) {
      const __m512bh w0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(w[i]));
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(vt2 + i * D + d0), w0);
      a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(vt2 + i * D + d0 + 16), w0);
    }
    _mm512_storeu_ps(acc + d0, _mm512_add_ps(a0, b0));
    _mm512_storeu_ps(acc + d0 + 16, _mm512_add_ps(a1, b1));
  }
}

// prefill_job for a bf16 or fp8 cache (D a multiple of 32) through vdpbf16ps: per tile the keys as bf16 pairs
// of adjacent dims, key by key in the lanes (kt2), the values as pairs of adjacent keys (vt2), the rows'
// queries and weights rounded to bf16 (bf16_pairs.h says how, and what it rounds). The running outputs stay
// in the values' pair order until the job ends.
template <typename KV>
static void prefill_job_bf16(const PrefillJob<KV>& jb, int64_t g, int64_t i0, int64_t i1, std::vector<float>& buf) {
  const int64_t D = jb.D, G = jb.G, nq = i1 - i0, R = G * nq, P = D / 2;
  buf.resize(static_cast<size_t>(P * kTk + (kTk / 2) * D + R * (D + 2) + R * P));
  uint32_t* kt2 = reinterpret_cast<uint32_t*>(buf.data());  // [P][kTk]
  uint32_t* vt2 = kt2 + P * kTk;                             // [kTk / 2][D]
  float* o = reinterpret_cast<float*>(vt2 + (kTk / 2) * D);  // [R][D] running outputs (pair order), * 2^-20
  float* m = o + R * D;                                      // [R]
  float* l = m + R;                                          // [R]
  uint32_t* q2 = reinterpret_cast<uint32_t*>(l + R);          // [R][P] the rows' queries times the scale
  const float operand = std::ldexp(1.f, kOperandExp<KV>);
  for (int64_t r = 0; r < R; ++r)
    to_bf16_scaled(row_query(jb, g, i0, nq, r), D, jb.scale * operand, reinterpret_cast<uint16_t*>(q2 + r * P));
  tile_walk(
      jb, i0, i1, R, m, l, o,
      [&](int64_t t0, int64_t n) {
        for (int64_t j = 0; j < kTk; ++j) {
          if (j < n) {
            const KV* kp = jb.k + (t0 + j) * jb.ks + g * jb.khs;
            for (int64_t d = 0; d < D; d += 32) {
              alignas(64) uint32_t pairs[16];
              _mm512_store_si512(pairs, load32_bf16(kp + d));
              for (int i = 0; i < 16; ++i) kt2[(d / 2 + i) * kTk + j] = pairs[i];
            }
          } else {
            for (int64_t q = 0; q < P; ++q) kt2[q * kTk + j] = 0;
          }
        }
        for (int64_t i = 0; i < kTk / 2; ++i) {
          const KV* v0 = jb.v + (t0 + 2 * i) * jb.vs + g * jb.vhs;
          const KV* v1 = v0 + jb.vs;
          for (int64_t d = 0; d < D; d += 32) {
            const __m512i x0 = 2 * i < n ? load32_bf16(v0 + d) : _mm512_setzero_si512();
            const __m512i x1 = 2 * i + 1 < n ? load32_bf16(v1 + d) : _mm512_setzero_si512();
            _mm512_storeu_si512(vt2 + i * D + d, _mm512_unpacklo_epi16(x0, x1));
            _mm512_storeu_si512(vt2 + i * D + d + 16, _mm512_unpackhi_epi16(x0, x1));
          }
        }
      },
      [&](int64_t r0, int rb, float (*sc)[kTk]) { tile_scores_bf16(q2 + r0 * P, P, kt2, rb, kProductUnit<KV>, sc); },
      [&](int64_t r, float corr, const float* s, int64_t n) {
        tile_values_bf16(o + r * D, D, corr, s, operand, vt2, static_cast<int>(n));
      });
  unpermute_pairs(o, R * D / 32);
  write_rows(jb, g, i0, nq, R, o, l, kProductUnit<KV>);
}
#endif

template <typename KV>
static void prefill_attention_t(torch::Tensor out, torch::Tensor query, torch::Tensor key, torch::Tensor value,
                                double scale, int64_t window) {
  const int64_t Lq = query.size(0), H = query.size(1), D = query.size(2), Lk = key.size(0), Hkv = key.size(1);
  const PrefillJob<KV> jb{query.data_ptr<float>(), query.stride(0), query.stride(1),
                          reinterpret_cast<const KV*>(key.data_ptr()), reinterpret_cast<const KV*>(value.data_ptr()),
                          key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                          out.data_ptr<float>(), out.stride(0), out.stride(1),
                          D, H / Hkv, Lk - Lq, window, static_cast<float>(scale)};
  const int64_t tiles = (Lq + kTq - 1) / kTq, jobs = tiles * Hkv;
  // a tile's cost grows with its position (causal): the threads take jobs from a shared counter, dearest
  // tiles first, so that the cheap ones at the end even out their shares
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), jobs));
  [[maybe_unused]] const bool bf16_passes = !std::is_same_v<KV, float> && D % 32 == 0 &&
                                            prefill_bf16.load(std::memory_order_relaxed);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> buf;
    for (int64_t job = next.fetch_add(1); job < jobs; job = next.fetch_add(1)) {
      const int64_t tile = tiles - 1 - job / Hkv, g = job % Hkv;
#if BATON_ISA >= BATON_ISA_AVX512_BF16
      if constexpr (!std::is_same_v<KV, float>) {
        if (bf16_passes) {
          prefill_job_bf16<KV>(jb, g, tile * kTq, std::min(Lq, (tile + 1) * kTq), buf);
          continue;
        }
      }
#endif
      prefill_job<KV>(jb, g, tile * kTq, std::min(Lq, (tile + 1) * kTq), buf);
    }
  });
}

void prefill_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key, torch::Tensor value,
                       double scale, int64_t window) {
  const auto kv = key.scalar_type();
  if (kv == at::kFloat)
    prefill_attention_t<float>(out, query, key, value, scale, window);
  else if (kv == at::kBFloat16)
    prefill_attention_t<uint16_t>(out, query, key, value, scale, window);
  else if (kv == at::kFloat8_e4m3fn)
    prefill_attention_t<fp8_e4m3>(out, query, key, value, scale, window);
  else
    prefill_attention_t<fp8_e5m2>(out, query, key, value, scale, window);
}
