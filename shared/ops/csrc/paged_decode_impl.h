// The paged decode attention's loops, compiled once per instruction-set level (isa_variants.h; the
// contract is in paged_decode_cpu.cpp): from avx512 up the wide path, at avx2 its 8-lane form, at portable
// the portable loops.

#include "simd_dot.h"  // inside the level's namespace: `dot` is vectorised for the level

#include "exp_simd.h"  // exp_nonpositive, for the softmax
#include "reduce8.h"   // reduce_max8 and reduce_add8 for the avx2 softmax
#include "widen16.h"   // load16 and kUnit: 16 cached values as fp32 from avx512 up (load8: 8 at avx2)
#include "bf16_pairs.h"  // load32_bf16 and the scales of the vdpbf16ps passes, from avx512_bf16 up

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

// Each of `rows` rows of n scores becomes exp(score - the row's max), in place; inv[j] = 1 / row j's sum.
// From avx512 up 16 scores a step through exp_nonpositive16 (the scalar loop's `omp simd` left it one
// scalar exp a score: 35% of the kernel's time at batch 32, Sapphire Rapids, perf); the sum is then 16
// lanes' partial sums added in a fixed order, so a row's result still depends on nothing but the row.
static void softmax_rows(float* scores, int64_t rows, int64_t n, float* inv) {
#if BATON_ISA >= BATON_ISA_AVX512
  for (int64_t j = 0; j < rows; ++j) {
    float* sc = scores + j * n;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sc + t));
    const __mmask16 tail = (__mmask16)((1u << (n - t)) - 1);
    mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, sc + t));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (t = 0; t + 16 <= n; t += 16) {
      const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(sc + t), m));
      _mm512_storeu_ps(sc + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    const __m512 last = _mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sc + t), m);
    const __m512 e = _mm512_maskz_mov_ps(tail, exp_nonpositive16(last));
    _mm512_mask_storeu_ps(sc + t, tail, e);
    inv[j] = 1.f / _mm512_reduce_add_ps(_mm512_add_ps(sum, e));
  }
#else
  for (int64_t j = 0; j < rows; ++j) {
    float* sc = scores + j * n;
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
#endif
}

#if BATON_ISA >= BATON_ISA_AVX2
// The wide paths' pieces, at avx2 and from avx512 up.

// Prefetches into L2 the cache lines of heads [h0, h1) of positions [t, t_end), a few at a time (`step`), so
// that the next chunk's lines arrive while this chunk is computed. One A/B on Zen 4 (batch 16, 100-token
// contexts, 30 layers' caches, medians of 15): spread over the chunk's passes into L2 4.3 ms; all of the
// next chunk's lines at its start into L2 5.5; spread into L1 5.2; none 6.1; the portable loops 5.2. Also
// fetching the thread's next job's first keys during the last value chunk (`Job::after`): 3.9 against 4.2.
// Where a position's heads lie side by side in whole lines (the cache's [block, slot, head, dim] layout) they
// are one run of lines, so a step is a tight loop over the run's lines: walking them head by head, line by
// line, cost a quarter of the kernel's time with the cache in L3 (bf16, batch 32, Zen 5, one thread: 13.3 ms
// for 30 layers against 9.9 with the prefetch off).
template <typename KV>
struct Prefetcher {
  const KV* base;
  const int64_t* off;  // position t's offset from base
  int64_t t, t_end, h0, h1, hs;
  int dvs;  // 64-byte lines per head
  int64_t h = h0;
  int64_t dv = 0;  // the next line of head h

  Prefetcher(const KV* base_, const int64_t* off_, int64_t t_, int64_t t_end_, int64_t h0_, int64_t h1_,
             int64_t hs_, int dvs_)
      : base(base_), off(off_), t(t_), t_end(t_end_), h0(h0_), h1(h1_), hs(hs_), dvs(dvs_), h(h0_) {
    if (h1 > h0 + 1 && hs * static_cast<int64_t>(sizeof(KV)) == int64_t{dvs} * 64) {  // adjacent heads: one run
      dvs *= static_cast<int>(h1 - h0);
      h1 = h0 + 1;
    }
  }
  Prefetcher() : Prefetcher(nullptr, nullptr, 0, 0, 0, 0, 0, 1) {}

  int64_t lines() const { return std::max<int64_t>(0, t_end - t) * (h1 - h0) * dvs; }
  void step(int64_t count) {
    while (count > 0 && t < t_end) {
      const char* p = reinterpret_cast<const char*>(base + off[t] + h * hs) + dv * 64;
      const int64_t n = std::min<int64_t>(count, dvs - dv);
      for (int64_t i = 0; i < n; ++i) __builtin_prefetch(p + i * 64, 0, 2);
      count -= n;
      if ((dv += n) == dvs) {
        dv = 0;
        if (++h == h1) h = h0, ++t;
      }
    }
  }
};

template <typename KV>
struct Job {
  const float* q;  // the job's first query head; head j at q + j * qhs
  int64_t qhs;
  const KV* kc;  // the caches, and each position's offset into them (through the block table)
  const KV* vc;
  const int64_t* koff;
  const int64_t* voff;
  int64_t khs, vhs;
  int64_t h0, h1, G, n;
  float scale;
  bool prefetch;  // decode_prefetch (paged_decode_cpu.cpp) when the call began
  Prefetcher<KV> after;  // what to fetch during the value pass's last chunk: the thread's next job's first keys
};
#endif

#if BATON_ISA == BATON_ISA_AVX2
#include "paged_decode_avx2.h"  // the 8-lane path
#endif

#if BATON_ISA >= BATON_ISA_AVX512
// The wide path. The portable loops spent ~460 cycles per (row, token) at SmolLM2's 9 heads on Zen 4 with
// the cache in L1/L2: an 8-lane dot product ending in a horizontal sum per score, and the value pass's sums
// round-tripping through memory. Here 16 scores come out of one transposing reduction and the sums stay in
// registers. A/B on Zen 4, two threads, 30 layers' caches with scattered blocks, medians of 15 (ms, wide
// against portable): batch 16 at 100-token contexts 3.9 / 5.0, batch 32 at 300 25.5 / 33.2, batch 64 at
// 200 32.4 / 42.4, one row at 500 2.0 / 2.8. Scores differ from the portable loops' in the order of the
// additions only; for a given row they do not depend on the batch.
constexpr int kChunk = 16;  // tokens whose scores come out of one transposing reduction (one AVX-512 vector)

// out[t] = the sum of p[t]'s 16 lanes, for 16 vectors at once: ~3 instructions a sum where a horizontal
// reduction of each takes ~8. The order of the additions is fixed, so a row's scores do not depend on the batch.
static inline __m512 lane_sums16(const __m512 (&p)[kChunk]) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)  // [a0+a2, b0+b2, a1+a3, b1+b3] in each 128-bit lane, for the pair (a, b)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]), _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // each 128-bit lane L holds its own part of vectors 4i .. 4i + 3
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit lanes (0 + 1, 2 + 3) of y[2i], then of y[2i + 1]
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
}

// 64-byte lines of one head's DV * 16 cached elements (an fp8 head of 32 is half a line)
template <int DV, typename KV>
constexpr int kLinesPerHead = (DV * 16 * static_cast<int>(sizeof(KV)) + 63) / 64;

// The score pass's walk, shared by its fp32 and bf16 forms: for each chunk of kChunk tokens and KV head h,
// `keys(t0, c, h)` makes the chunk's keys of that head ready in L1, then for each of h's query heads j
// `dots(j, t0, c, h, p)` fills p[t] with the 16 lanes whose sum is q_j . k_t (zero for t >= c), and one
// transposing reduction stores the 16 scores times `unit`. The next chunk's keys are prefetched meanwhile (in
// the last chunk the first values), a few lines per query head.
template <int DV, typename KV, typename Keys, typename Dots>
static inline void score_walk(const Job<KV>& jb, float unit, float* scores, Keys&& keys, Dots&& dots) {
  const int64_t passes = (jb.h1 - jb.h0) * jb.G;
  for (int64_t t0 = 0; t0 < jb.n; t0 += kChunk) {
    const int c = (int)std::min<int64_t>(kChunk, jb.n - t0);
    constexpr int lines = kLinesPerHead<DV, KV>;
    Prefetcher<KV> pf = t0 + c < jb.n
        ? Prefetcher<KV>{jb.kc, jb.koff, t0 + c, std::min(jb.n, t0 + c + kChunk), jb.h0, jb.h1, jb.khs, lines}
        : Prefetcher<KV>{jb.vc, jb.voff, 0, std::min<int64_t>(kChunk, jb.n), jb.h0, jb.h1, jb.vhs, lines};
    const int64_t per_pass = jb.prefetch ? (pf.lines() + passes - 1) / passes : 0;
    for (int64_t h = jb.h0; h < jb.h1; ++h) {
      keys(t0, c, h);
      for (int64_t g = 0; g < jb.G; ++g) {
        pf.step(per_pass);
        const int64_t j = (h - jb.h0) * jb.G + g;
        __m512 p[kChunk];
        dots(j, t0, c, h, p);
        const __m512 s = _mm512_mul_ps(lane_sums16(p), _mm512_set1_ps(unit));
        _mm512_mask_storeu_ps(scores + j * jb.n + t0, (__mmask16)((1u << c) - 1), s);
      }
    }
  }
}

// The value pass's walk, shared by its fp32 and bf16 forms: for each chunk of kChunk tokens, KV head h and
// group of up to GB of h's query heads (from j0, gn of them), the group's sums are loaded into registers,
// `tokens(t0, c, h, j0, gn, a)` adds the chunk's tokens to them, and they are stored back. The next chunk's
// values are prefetched meanwhile (in the last chunk the next job's first keys), a few lines per group.
template <int DV, int GB, typename KV, typename Tokens>
static inline void value_walk(const Job<KV>& jb, float* acc, Tokens&& tokens) {
  constexpr int64_t D = DV * 16;
  const int64_t passes = (jb.h1 - jb.h0) * ((jb.G + GB - 1) / GB);
  for (int64_t t0 = 0; t0 < jb.n; t0 += kChunk) {
    const int64_t c = std::min<int64_t>(kChunk, jb.n - t0);
    Prefetcher<KV> pf = t0 + c < jb.n
        ? Prefetcher<KV>{jb.vc, jb.voff, t0 + c, std::min(jb.n, t0 + c + kChunk), jb.h0, jb.h1, jb.vhs,
                         kLinesPerHead<DV, KV>}
        : jb.after;
    const int64_t per_pass = jb.prefetch ? (pf.lines() + passes - 1) / passes : 0;
    for (int64_t h = jb.h0; h < jb.h1; ++h) {
      for (int64_t g0 = 0; g0 < jb.G; g0 += GB) {
        pf.step(per_pass);
        const int64_t j0 = (h - jb.h0) * jb.G + g0;
        const int gn = (int)std::min<int64_t>(GB, jb.G - g0);
        __m512 a[GB][DV];
        for (int g = 0; g < GB; ++g)
          if (g < gn)
            for (int dv = 0; dv < DV; ++dv) a[g][dv] = _mm512_loadu_ps(acc + (j0 + g) * D + dv * 16);
        tokens(t0, c, h, j0, gn, a);
        for (int g = 0; g < GB; ++g)
          if (g < gn)
            for (int dv = 0; dv < DV; ++dv) _mm512_storeu_ps(acc + (j0 + g) * D + dv * 16, a[g][dv]);
      }
    }
  }
}

// Query heads whose value sums one group keeps in registers (16 of the 32 zmm)
template <int DV>
constexpr int kValueGroup = 16 / DV > 0 ? 16 / DV : 1;

// scores[j * n + t] = q_j . k_t * scale for the job's query heads j, a chunk of tokens at a time (their keys,
// all heads, stay in L1 while every head reads them)
template <int DV, typename KV>
static void scores_avx512(const Job<KV>& jb, float* scores) {
  constexpr int64_t D = DV * 16;
  // A bf16 chunk's keys of one KV head, widened once into fp32 here (in L1) for that head's G query heads,
  // where each used to widen them itself (a load, a zero-extension and a shift per 16 values, against one
  // FMA). With the vector softmax: batch 32, 300-token contexts, SmolLM2's heads, one thread on Sapphire
  // Rapids, 2.2 ms a layer before, 0.72 after; a decode step's attention (bench/decode_profile.py
  // --python-layers, two threads) 25.8 and 28.7 ms before, 17.2 and 16.3 after. An fp32 cache is read in
  // place.
  constexpr bool kWiden = !std::is_same_v<KV, float>;
  alignas(64) float widened[kWiden ? kChunk * D : 1];
  score_walk<DV, KV>(
      jb, jb.scale, scores,
      [&](int64_t t0, int c, int64_t h) {
        if constexpr (kWiden)
          for (int t = 0; t < c; ++t) {
            const KV* k = jb.kc + jb.koff[t0 + t] + h * jb.khs;
            for (int dv = 0; dv < DV; ++dv) _mm512_store_ps(widened + t * D + dv * 16, load16(k + dv * 16));
          }
      },
      [&](int64_t j, int64_t t0, int c, int64_t h, __m512 (&p)[kChunk]) {
        const float* qv = jb.q + j * jb.qhs;
        __m512 qr[DV];
        for (int dv = 0; dv < DV; ++dv)
          qr[dv] = kUnit<KV> == 1.f ? _mm512_loadu_ps(qv + dv * 16)
                                    : _mm512_mul_ps(_mm512_loadu_ps(qv + dv * 16), _mm512_set1_ps(kUnit<KV>));
        for (int t = 0; t < kChunk; ++t) {
          if (t < c) {
            const float* k = kWiden ? widened + t * D
                                    : reinterpret_cast<const float*>(jb.kc + jb.koff[t0 + t] + h * jb.khs);
            __m512 s = _mm512_mul_ps(qr[0], _mm512_loadu_ps(k));
            for (int dv = 1; dv < DV; ++dv) s = _mm512_fmadd_ps(qr[dv], _mm512_loadu_ps(k + dv * 16), s);
            p[t] = s;
          } else {
            p[t] = _mm512_setzero_ps();
          }
        }
      });
}

// acc[j * D + d] = sum over t of w[j * n + t] * v_t[d], a chunk at a time, each value vector loaded once for
// as many of its KV head's query heads as keep their sums in registers (kValueGroup). The sum over t runs in
// order, as the portable loop's.
template <int DV, typename KV>
static void values_avx512(const Job<KV>& jb, const float* w, float* acc) {
  constexpr int GB = kValueGroup<DV>;
  value_walk<DV, GB, KV>(jb, acc, [&](int64_t t0, int64_t c, int64_t h, int64_t j0, int gn, __m512 (&a)[GB][DV]) {
    for (int64_t t = t0; t < t0 + c; ++t) {
      const KV* v = jb.vc + jb.voff[t] + h * jb.vhs;
      __m512 vv[DV];
      for (int dv = 0; dv < DV; ++dv) vv[dv] = load16(v + dv * 16);
      for (int g = 0; g < GB; ++g)
        if (g < gn) {
          const __m512 wt = _mm512_set1_ps(w[(j0 + g) * jb.n + t]);
          for (int dv = 0; dv < DV; ++dv) a[g][dv] = _mm512_fmadd_ps(wt, vv[dv], a[g][dv]);
        }
    }
  });
}

// acc[j * D ...] = the job's unnormalised outputs, inv[j] their normalisers
template <int DV, typename KV>
static void attend_avx512(const Job<KV>& jb, float* scores, float* inv, float* acc) {
  scores_avx512<DV, KV>(jb, scores);
  softmax_rows(scores, (jb.h1 - jb.h0) * jb.G, jb.n, inv);
  if constexpr (kUnit<KV> != 1.f)  // the values' sums are of value / kUnit
    for (int64_t j = 0; j < (jb.h1 - jb.h0) * jb.G; ++j) inv[j] *= kUnit<KV>;
  values_avx512<DV, KV>(jb, scores, acc);
}

#if BATON_ISA >= BATON_ISA_AVX512_BF16
// avx512_bf16 and up, for a bf16 or fp8 cache: both passes as vdpbf16ps, two products a lane per instruction,
// the cache read as bf16 (bf16_pairs.h says how, and what it rounds), where the fp32 passes above widen every
// cached value to fp32 first and take one FMA per product. The order of the additions is fixed, so a row's
// result still depends on nothing but the row.

// scores as scores_avx512's, each q . k a sum of DV / 2 vdpbf16ps over the bf16 query (qb: per query head j,
// D values at qb + j * D) and the chunk's keys, made bf16 once per KV head in L1 (read in place from a bf16
// cache)
template <int DV, typename KV>
static void scores_bf16dp(const Job<KV>& jb, const uint16_t* qb, float* scores) {
  constexpr int64_t D = DV * 16, DP = DV / 2;  // bf16 vectors per head
  constexpr bool kConvert = !std::is_same_v<KV, uint16_t>;
  alignas(64) uint16_t keys[kConvert ? kChunk * D : 1];
  score_walk<DV, KV>(
      jb, jb.scale * kProductUnit<KV>, scores,
      [&](int64_t t0, int c, int64_t h) {
        if constexpr (kConvert)
          for (int t = 0; t < c; ++t) {
            const KV* k = jb.kc + jb.koff[t0 + t] + h * jb.khs;
            for (int v = 0; v < DP; ++v) _mm512_store_si512(keys + t * D + v * 32, load32_bf16(k + v * 32));
          }
      },
      [&](int64_t j, int64_t t0, int c, int64_t h, __m512 (&p)[kChunk]) {
        __m512bh qr[DP];
        for (int v = 0; v < DP; ++v) qr[v] = (__m512bh)_mm512_loadu_si512(qb + j * D + v * 32);
        for (int t = 0; t < kChunk; ++t) {
          if (t < c) {
            const uint16_t* k = kConvert ? keys + t * D
                                         : reinterpret_cast<const uint16_t*>(jb.kc + jb.koff[t0 + t] + h * jb.khs);
            __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), qr[0], (__m512bh)_mm512_loadu_si512(k));
            for (int v = 1; v < DP; ++v) s = _mm512_dpbf16_ps(s, qr[v], (__m512bh)_mm512_loadu_si512(k + v * 32));
            p[t] = s;
          } else {
            p[t] = _mm512_setzero_ps();
          }
        }
      });
}

// acc as values_avx512's, two tokens a vdpbf16ps: the values of tokens t and t + 1 interleaved (within each
// 128-bit lane, so each 32 dims' sums sit in two registers in the order `unpermute_pairs` undoes) against the
// bf16 pair (w_t, w_t+1) of the weights (wb: per query head j, n rounded up to 32 values at wb + j * wn)
template <int DV, typename KV>
static void values_bf16dp(const Job<KV>& jb, const uint16_t* wb, int64_t wn, float* acc) {
  constexpr int GB = kValueGroup<DV>;
  constexpr int64_t DP = DV / 2;
  value_walk<DV, GB, KV>(jb, acc, [&](int64_t t0, int64_t c, int64_t h, int64_t j0, int gn, __m512 (&a)[GB][DV]) {
    for (int64_t t = t0; t < t0 + c; t += 2) {
      const KV* v0 = jb.vc + jb.voff[t] + h * jb.vhs;
      const bool pair = t + 1 < t0 + c;
      const KV* v1 = pair ? jb.vc + jb.voff[t + 1] + h * jb.vhs : v0;
      __m512bh lo[DP], hi[DP];
      for (int v = 0; v < DP; ++v) {
        const __m512i x0 = load32_bf16(v0 + v * 32);
        const __m512i x1 = pair ? load32_bf16(v1 + v * 32) : _mm512_setzero_si512();
        lo[v] = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
        hi[v] = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
      }
      for (int g = 0; g < GB; ++g)
        if (g < gn) {  // (w_t, w_t+1): one 32-bit pair of the row's bf16 weights (t is even)
          const __m512bh wt = (__m512bh)_mm512_set1_epi32(reinterpret_cast<const int32_t*>(wb + (j0 + g) * wn)[t / 2]);
          for (int v = 0; v < DP; ++v) {
            a[g][2 * v] = _mm512_dpbf16_ps(a[g][2 * v], lo[v], wt);
            a[g][2 * v + 1] = _mm512_dpbf16_ps(a[g][2 * v + 1], hi[v], wt);
          }
        }
    }
  });
}

// attend_avx512's outputs through the bf16 passes; `bf` holds the bf16 query and weights
template <int DV, typename KV>
static void attend_bf16dp(const Job<KV>& jb, float* scores, float* inv, float* acc, std::vector<uint16_t>& bf) {
  constexpr int64_t D = DV * 16;
  const int64_t nq = (jb.h1 - jb.h0) * jb.G, wn = (jb.n + 31) / 32 * 32;
  bf.resize(nq * (D + wn));
  uint16_t* qb = bf.data();
  uint16_t* wb = qb + nq * D;
  const float qscale = std::ldexp(1.f, kOperandExp<KV>);
  for (int64_t j = 0; j < nq; ++j) to_bf16_scaled(jb.q + j * jb.qhs, D, qscale, qb + j * D);
  scores_bf16dp<DV, KV>(jb, qb, scores);
  softmax_rows(scores, nq, jb.n, inv);
  for (int64_t j = 0; j < nq; ++j) {
    to_bf16_scaled(scores + j * jb.n, jb.n, qscale, wb + j * wn);
    inv[j] *= kProductUnit<KV>;
  }
  values_bf16dp<DV, KV>(jb, wb, wn, acc);
  unpermute_pairs(acc, nq * D / 32);
}
#endif
#endif

// KV: float (an fp32 cache), uint16_t (a bf16 cache's bits) or fp8_e4m3 / fp8_e5m2, widened as they are read
template <typename KV>
static void paged_decode_t(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor rows, torch::Tensor row_seq,
                           torch::Tensor row_pos, double scale, int64_t window) {
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
  const KV* kc = static_cast<const KV*>(k_cache.data_ptr());
  const KV* vc = static_cast<const KV*>(v_cache.data_ptr());
  const int64_t kbs = k_cache.stride(0), kts = k_cache.stride(1), khs = k_cache.stride(2);
  const int64_t vbs = v_cache.stride(0), vts = v_cache.stride(1), vhs = v_cache.stride(2);
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t btw = block_tables.stride(0);
  const int64_t* ri = rows.data_ptr<int64_t>();
  const int64_t* rs = row_seq.data_ptr<int64_t>();
  const int64_t* rp = row_pos.data_ptr<int64_t>();
  const int64_t qrs = query.stride(0), qhs = query.stride(1), ors = out.stride(0), ohs = out.stride(1);
  const float fscale = (float)scale;
  const bool prefetch = decode_prefetch.load(std::memory_order_relaxed);
  [[maybe_unused]] const bool bf16_passes = decode_bf16.load(std::memory_order_relaxed);
  // A job is a row's KV heads [h0, h1): the whole row when rows alone keep every thread busy (a token's
  // keys for all heads are then one contiguous read), else the row's heads split across jobs
  const int64_t threads = at::get_num_threads();
  const int64_t splits = std::clamp<int64_t>((2 * threads + R - 1) / R, 1, Hkv);
  const int64_t heads_per_job = (Hkv + splits - 1) / splits;
  struct Span {
    int64_t i, h0, h1, lo, n;  // row i (of `rows`), its KV heads [h0, h1), positions lo .. lo + n - 1
    const int32_t* table;
  };
  auto span_of = [&](int64_t job) {
    const int64_t i = job / splits, h0 = (job % splits) * heads_per_job, pos = rp[i];
    const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
    return Span{i, h0, std::min(Hkv, h0 + heads_per_job), lo, pos - lo + 1, bt + rs[i] * btw};
  };
#if BATON_ISA >= BATON_ISA_AVX512
  const int64_t dv = D % 16 == 0 ? D / 16 : 0;
  const bool wide = dv == 2 || dv == 4 || dv == 8 || dv == 16;
#elif BATON_ISA == BATON_ISA_AVX2
  const bool wide = D % 8 == 0 && D <= kMaxWideDim;
#endif
  // A thread owns a contiguous range of jobs and prefetches the first keys of the job it runs next; one done
  // early takes the others' last jobs (steal_for.h)
  struct Scratch {
    std::vector<float> scores, acc, inv;
    std::vector<int64_t> koff, voff;
    std::vector<uint16_t> bf;  // the bf16 passes' query and weights (avx512_bf16 and up)
  };
  std::vector<Scratch> scratch(std::max<int64_t>(threads, 1));
  parallel_steal_steps(R * splits, 1, [&](int64_t job, int64_t next_job) {
    Scratch& sc = scratch[std::min<int64_t>(at::get_thread_num(), threads - 1)];  // the region's threads
    std::vector<float>& scores = sc.scores;
    std::vector<float>& acc = sc.acc;
    std::vector<float>& inv = sc.inv;
    std::vector<int64_t>& koff = sc.koff;
    std::vector<int64_t>& voff = sc.voff;
    [[maybe_unused]] std::vector<uint16_t>& bf = sc.bf;
    const Span sp = span_of(job);
    const int64_t h0 = sp.h0, h1 = sp.h1, lo = sp.lo, n = sp.n, r = ri[sp.i];
    if (h0 >= h1) return;
    const int64_t nq = (h1 - h0) * G;  // query heads of this job, in order h0 * G ...
    scores.resize(nq * n);
    inv.resize(nq);
    acc.assign(nq * D, 0.f);
    const int32_t* table = sp.table;
    const float* qj = q + r * qrs + h0 * G * qhs;
#if BATON_ISA >= BATON_ISA_AVX2
    if (wide) {
      koff.resize(n);
      voff.resize(n);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t p = lo + t, block = table[p / bs], slot = p % bs;
        koff[t] = block * kbs + slot * kts;
        voff[t] = block * vbs + slot * vts;
      }
      Job<KV> jb{qj, qhs, kc, vc, koff.data(), voff.data(), khs, vhs, h0, h1, G, n, fscale, prefetch, {}};
      int64_t next_koff[kChunk];
      if (next_job >= 0) {
        const Span nx = span_of(next_job);
        const int64_t m = std::min<int64_t>(kChunk, nx.n);
        for (int64_t t = 0; t < m; ++t) {
          const int64_t p = nx.lo + t;
          next_koff[t] = nx.table[p / bs] * kbs + (p % bs) * kts;
        }
        jb.after = Prefetcher<KV>{kc, next_koff, 0, nx.h0 < nx.h1 ? m : 0, nx.h0, nx.h1, khs,
                                  (int)((D * sizeof(KV) + 63) / 64)};
      }
#if BATON_ISA >= BATON_ISA_AVX512_BF16
      constexpr bool kNarrow = !std::is_same_v<KV, float>;  // an fp32 cache keeps the fp32 passes
      if (kNarrow && bf16_passes) {
        if constexpr (kNarrow) {
          if (dv == 2) attend_bf16dp<2, KV>(jb, scores.data(), inv.data(), acc.data(), bf);
          else if (dv == 4) attend_bf16dp<4, KV>(jb, scores.data(), inv.data(), acc.data(), bf);
          else if (dv == 8) attend_bf16dp<8, KV>(jb, scores.data(), inv.data(), acc.data(), bf);
          else attend_bf16dp<16, KV>(jb, scores.data(), inv.data(), acc.data(), bf);
        }
      } else
#endif
      {
#if BATON_ISA >= BATON_ISA_AVX512
        if (dv == 2) attend_avx512<2, KV>(jb, scores.data(), inv.data(), acc.data());
        else if (dv == 4) attend_avx512<4, KV>(jb, scores.data(), inv.data(), acc.data());
        else if (dv == 8) attend_avx512<8, KV>(jb, scores.data(), inv.data(), acc.data());
        else attend_avx512<16, KV>(jb, scores.data(), inv.data(), acc.data());
#else
        attend_avx2<KV>(jb, D, scores.data(), inv.data(), acc.data());
#endif
      }
    } else
#endif
    {
      for_each_slot(table, bs, lo, n, [&](int64_t t, int64_t block, int64_t slot, int64_t pb, int64_t ps) {
        const KV* kt = kc + block * kbs + slot * kts;
        const KV* kp = kc + pb * kbs + ps * kts;
        for (int64_t h = h0; h < h1; ++h) {
          const KV* k = kt + h * khs;
          for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(kp + h * khs + d);
          for (int64_t g = 0; g < G; ++g) {
            const int64_t j = (h - h0) * G + g;
            scores[j * n + t] = dot(qj + j * qhs, k, D) * fscale;
          }
        }
      });
      softmax_rows(scores.data(), nq, n, inv.data());
      // weights times values, a token at a time for all the job's heads (the sums, nq * D floats, stay in L1)
      for_each_slot(table, bs, lo, n, [&](int64_t t, int64_t block, int64_t slot, int64_t pb, int64_t ps) {
        const KV* vt = vc + block * vbs + slot * vts;
        const KV* vp = vc + pb * vbs + ps * vts;
        for (int64_t h = h0; h < h1; ++h) {
          const KV* __restrict v = vt + h * vhs;
          for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(vp + h * vhs + d);
          for (int64_t g = 0; g < G; ++g) {
            const int64_t j = (h - h0) * G + g;
            const float w = scores[j * n + t];
            float* __restrict a = acc.data() + j * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += w * to_f32(v[d]);
          }
        }
      });
    }
    for (int64_t j = 0; j < nq; ++j) {
      float* oo = o + r * ors + (h0 * G + j) * ohs;
      for (int64_t d = 0; d < D; ++d) oo[d] = acc[j * D + d] * inv[j];
    }
  });
}


void paged_decode(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor block_tables, torch::Tensor rows, torch::Tensor row_seq, torch::Tensor row_pos,
                  double scale, int64_t window) {
  const auto kv = k_cache.scalar_type();
  TORCH_CHECK(query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && v_cache.scalar_type() == kv &&
              (kv == at::kFloat || kv == at::kBFloat16 || kv == at::kFloat8_e4m3fn || kv == at::kFloat8_e5m2),
              "paged_decode: float32 queries, a float32, bfloat16 or float8 (e4m3fn, e5m2) cache");
  if (kv == at::kFloat)
    paged_decode_t<float>(out, query, k_cache, v_cache, block_tables, rows, row_seq, row_pos, scale, window);
  else if (kv == at::kBFloat16)
    paged_decode_t<uint16_t>(out, query, k_cache, v_cache, block_tables, rows, row_seq, row_pos, scale, window);
  else if (kv == at::kFloat8_e4m3fn)
    paged_decode_t<fp8_e4m3>(out, query, k_cache, v_cache, block_tables, rows, row_seq, row_pos, scale, window);
  else
    paged_decode_t<fp8_e5m2>(out, query, k_cache, v_cache, block_tables, rows, row_seq, row_pos, scale, window);
}
