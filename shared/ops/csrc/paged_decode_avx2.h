// The paged decode kernel's wide path on 8 lanes, for the avx2 level (AVX2, FMA, F16C: Zen 2 and 3, Haswell
// to Alder Lake, none with AVX-512): the avx512 path's shape (paged_decode_impl.h) on ymm registers.
// No `#pragma once`: paged_decode_impl.h includes it inside the avx2 level's namespace, after Prefetcher and Job.
//
// The portable loops read an fp8 cache through a 256-entry table, a load per value, and end every score in a
// horizontal sum; here a chunk's keys (values) of a KV head are widened once into fp32 in L1 for all of its
// query heads (fp8 through vcvtph2ps, widen16.h's load8), 8 scores come out of one transposing reduction,
// and the value sums stay in registers over the chunk. A head_dim that is a multiple of 8, up to 512, takes
// it. Scores differ from the portable loops' in the order of the additions only; for a given row they do not
// depend on the batch or the threads. Batch 32 at 300-token contexts, SmolLM2's heads, 4 layers' caches in turn with
// scattered blocks, Zen 3, best of 9 on a machine another benchmark shared (ms a call, 8-lane against
// portable): two threads, an fp8 e4m3 cache 0.98 / 4.2, bf16 1.0 / 2.5, fp32 0.96 / 2.7; one thread's CPU
// time 1.2 / 5.7, 1.3 / 3.1, 1.5 / 3.4. The prefetch (Prefetcher) is worth 1.2 against 1.9 (e4m3, one thread).
constexpr int kChunk = 8;  // tokens whose scores come out of one transposing reduction (one ymm vector)
// The widest head it takes (Gemma 4's global layers): a chunk's widened keys, 16 KB, stay in L1
constexpr int64_t kMaxWideDim = 512;

// All ones in lanes [0, c), zero above: the lanes of a short chunk or of a row's last scores, for maskload
// and maskstore
static inline __m256i first_lanes(int64_t c) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// softmax_rows on 8 lanes: each of `rows` rows of n scores becomes exp(score - the row's max), in place;
// inv[j] = 1 / row j's sum, 8 lanes' partial sums added in a fixed order
static void softmax_rows8(float* scores, int64_t rows, int64_t n, float* inv) {
  for (int64_t j = 0; j < rows; ++j) {
    float* sc = scores + j * n;
    __m256 mx = _mm256_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sc + t));
    const __m256i tail = first_lanes(n - t);
    const __m256 last = _mm256_maskload_ps(sc + t, tail);  // 0 in the lanes past n: -inf for the max
    mx = _mm256_max_ps(mx, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), last, _mm256_castsi256_ps(tail)));
    const __m256 m = _mm256_set1_ps(reduce_max8(mx));
    __m256 sum = _mm256_setzero_ps();
    for (t = 0; t + 8 <= n; t += 8) {
      const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(sc + t), m));
      _mm256_storeu_ps(sc + t, e);
      sum = _mm256_add_ps(sum, e);
    }
    const __m256 e = _mm256_and_ps(exp_nonpositive8(_mm256_sub_ps(last, m)), _mm256_castsi256_ps(tail));
    _mm256_maskstore_ps(sc + t, tail, e);
    inv[j] = 1.f / reduce_add8(_mm256_add_ps(sum, e));
  }
}

// out[t] = the sum of p[t]'s 8 lanes, for 8 vectors at once (lane_sums16's reduction on 8 lanes): 14
// shuffles and 7 adds for 8 sums, in a fixed order
static inline __m256 lane_sums8(const __m256 (&p)[kChunk]) {
  __m256 x[4], y[2];
  for (int i = 0; i < 4; ++i)  // [a0+a2, b0+b2, a1+a3, b1+b3] in each 128-bit lane, for the pair (a, b)
    x[i] = _mm256_add_ps(_mm256_unpacklo_ps(p[2 * i], p[2 * i + 1]), _mm256_unpackhi_ps(p[2 * i], p[2 * i + 1]));
  for (int i = 0; i < 2; ++i) {  // each 128-bit lane holds its own part of vectors 4i .. 4i + 3
    const __m256d a = _mm256_castps_pd(x[2 * i]), b = _mm256_castps_pd(x[2 * i + 1]);
    y[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(y[0], y[1], 0x20), _mm256_permute2f128_ps(y[0], y[1], 0x31));
}

// 64-byte lines of one cached head of D values
template <typename KV>
constexpr int lines_per_head(int64_t D) {
  return static_cast<int>((D * static_cast<int64_t>(sizeof(KV)) + 63) / 64);
}

// rows[t] = the chunk's token t's D values (of one head: `head` is the cache plus the head's offset, off[t]
// the token's offset from it) as fp32, for t < c: read in place from an fp32 cache, else widened into
// `widened` (kChunk rows of D). A short chunk's missing rows are its first again (their scores are dropped).
template <typename KV>
static inline void chunk_rows(const KV* head, const int64_t* off, int c, int64_t D, float* widened,
                              const float* (&rows)[kChunk]) {
  for (int t = 0; t < c; ++t) {
    if constexpr (std::is_same_v<KV, float>) {
      rows[t] = head + off[t];
    } else {
      float* row = widened + t * D;
      for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(row + d, load8(head + off[t] + d));
      rows[t] = row;
    }
  }
  for (int t = c; t < kChunk; ++t) rows[t] = rows[0];
}

// scores[j * n + t] = q_j . k_t * scale for the job's query heads j, a chunk of tokens at a time (their keys of
// one KV head ready in L1 for its G query heads); the next chunk's keys (in the last chunk the first values)
// are prefetched meanwhile, a few lines per query head, as score_walk does from avx512 up
template <typename KV>
static void scores_avx2(const Job<KV>& jb, int64_t D, float* scores) {
  alignas(32) float widened[std::is_same_v<KV, float> ? 1 : kChunk * kMaxWideDim];
  const int lines = lines_per_head<KV>(D);
  const int64_t passes = (jb.h1 - jb.h0) * jb.G;
  const __m256 unit = _mm256_set1_ps(jb.scale * kUnit<KV>);  // the keys were read / kUnit: exact, a power of 2
  for (int64_t t0 = 0; t0 < jb.n; t0 += kChunk) {
    const int c = (int)std::min<int64_t>(kChunk, jb.n - t0);
    Prefetcher<KV> pf = t0 + c < jb.n
        ? Prefetcher<KV>{jb.kc, jb.koff, t0 + c, std::min(jb.n, t0 + c + kChunk), jb.h0, jb.h1, jb.khs, lines}
        : Prefetcher<KV>{jb.vc, jb.voff, 0, std::min<int64_t>(kChunk, jb.n), jb.h0, jb.h1, jb.vhs, lines};
    const int64_t per_pass = jb.prefetch ? (pf.lines() + passes - 1) / passes : 0;
    const __m256i valid = first_lanes(c);
    for (int64_t h = jb.h0; h < jb.h1; ++h) {
      const float* k[kChunk];
      chunk_rows(jb.kc + h * jb.khs, jb.koff + t0, c, D, widened, k);
      for (int64_t g = 0; g < jb.G; ++g) {
        pf.step(per_pass);
        const int64_t j = (h - jb.h0) * jb.G + g;
        const float* q = jb.q + j * jb.qhs;
        __m256 p[kChunk];  // token t's 8 lanes of q . k_t: 8 independent FMA chains, as many as hide the latency
        for (int t = 0; t < kChunk; ++t) p[t] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 qd = _mm256_loadu_ps(q + d);
          for (int t = 0; t < kChunk; ++t) p[t] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k[t] + d), p[t]);
        }
        _mm256_maskstore_ps(scores + j * jb.n + t0, valid, _mm256_mul_ps(lane_sums8(p), unit));
      }
    }
  }
}

// One chunk of the value pass, for one KV head: its tokens' values and weights, and where the sums are
struct ValueChunk {
  const float* v[kChunk];  // token t's values, fp32
  int c;                   // tokens in the chunk
  const float* w;          // query head j's weight of token t at w[j * n + t]
  int64_t n;
  float* acc;  // query head j's sums at acc + j * D
  int64_t D;
};

// The sums of query heads j0 .. j0 + gn - 1, dims [d0, d0 + 8 * SW), plus the chunk's tokens' weighted values,
// in token order. GB * SW = 8 sums in registers: 8 independent FMA chains for D >= 64 (one head at a time,
// its sums in 8 ymm), and for narrower heads as many by taking GB heads at once (a token's values loaded once
// for them).
template <int SW>
static inline void add_values(const ValueChunk& ch, int64_t j0, int gn, int64_t d0) {
  constexpr int GB = kChunk / SW;
  float* sums = ch.acc + j0 * ch.D + d0;
  const float* w = ch.w + j0 * ch.n;
  __m256 a[GB][SW];
  for (int g = 0; g < GB; ++g)
    if (g < gn)
      for (int s = 0; s < SW; ++s) a[g][s] = _mm256_loadu_ps(sums + g * ch.D + 8 * s);
  for (int t = 0; t < ch.c; ++t) {
    const float* v = ch.v[t] + d0;
    for (int g = 0; g < GB; ++g)
      if (g < gn) {
        const __m256 wt = _mm256_broadcast_ss(w + g * ch.n + t);
        for (int s = 0; s < SW; ++s) a[g][s] = _mm256_fmadd_ps(wt, _mm256_loadu_ps(v + 8 * s), a[g][s]);
      }
  }
  for (int g = 0; g < GB; ++g)
    if (g < gn)
      for (int s = 0; s < SW; ++s) _mm256_storeu_ps(sums + g * ch.D + 8 * s, a[g][s]);
}

// acc[j * D + d] = sum over t of w[j * n + t] * v_t[d], a chunk at a time (its values of one KV head widened
// once, in L1, for the head's G query heads), a head's dims in slices of 8, 4, 2 and 1 vectors (add_values);
// the next chunk's values (in the last chunk the next job's first keys) are prefetched meanwhile. The sum over
// t runs in order, as the portable loop's.
template <typename KV>
static void values_avx2(const Job<KV>& jb, int64_t D, const float* w, float* acc) {
  alignas(32) float widened[std::is_same_v<KV, float> ? 1 : kChunk * kMaxWideDim];
  const int lines = lines_per_head<KV>(D);
  const int64_t passes = (jb.h1 - jb.h0) * jb.G;
  for (int64_t t0 = 0; t0 < jb.n; t0 += kChunk) {
    const int c = (int)std::min<int64_t>(kChunk, jb.n - t0);
    Prefetcher<KV> pf = t0 + c < jb.n
        ? Prefetcher<KV>{jb.vc, jb.voff, t0 + c, std::min(jb.n, t0 + c + kChunk), jb.h0, jb.h1, jb.vhs, lines}
        : jb.after;
    const int64_t per_pass = jb.prefetch ? (pf.lines() + passes - 1) / passes : 0;
    ValueChunk ch{{}, c, w + t0, jb.n, acc, D};
    for (int64_t h = jb.h0; h < jb.h1; ++h) {
      chunk_rows(jb.vc + h * jb.vhs, jb.voff + t0, c, D, widened, ch.v);
      const int64_t j = (h - jb.h0) * jb.G;
      for (int64_t d0 = 0; d0 < D;) {
        const int64_t vecs = (D - d0) / 8;
        const int sw = vecs >= 8 ? 8 : vecs >= 4 ? 4 : vecs >= 2 ? 2 : 1;
        for (int64_t g0 = 0; g0 < jb.G; g0 += kChunk / sw) {
          const int gn = (int)std::min<int64_t>(kChunk / sw, jb.G - g0);
          if (d0 == 0) pf.step(per_pass * gn);
          if (sw == 8) add_values<8>(ch, j + g0, gn, d0);
          else if (sw == 4) add_values<4>(ch, j + g0, gn, d0);
          else if (sw == 2) add_values<2>(ch, j + g0, gn, d0);
          else add_values<1>(ch, j + g0, gn, d0);
        }
        d0 += 8 * sw;
      }
    }
  }
}

// acc[j * D ...] = the job's unnormalised outputs, inv[j] their normalisers (attend_avx512's steps)
template <typename KV>
static void attend_avx2(const Job<KV>& jb, int64_t D, float* scores, float* inv, float* acc) {
  scores_avx2<KV>(jb, D, scores);
  softmax_rows8(scores, (jb.h1 - jb.h0) * jb.G, jb.n, inv);
  if constexpr (kUnit<KV> != 1.f)  // the values' sums are of value / kUnit
    for (int64_t j = 0; j < (jb.h1 - jb.h0) * jb.G; ++j) inv[j] *= kUnit<KV>;
  values_avx2<KV>(jb, D, scores, acc);
}
