// Paged attention for short query rows (decodes, draft verification) on the CPU: fp32 queries, an fp32 or
// bf16 cache (widened to fp32 as it is read; the arithmetic is fp32 either way).
//
// For each listed query row r (a token of sequence row_seq[i] at position row_pos[i]) and each query
// head: softmax over keys t in (pos - window, pos] of q·k_t * scale, times v_t. Keys and values are
// read in place from the paged cache through the block table, so nothing is gathered into a
// contiguous copy first (the torch reference's cost: a copy of every sequence's context per layer).
// A job is one row (or, when there are few rows, part of its KV heads): each key and value vector is
// loaded once for all query heads that share it. With AVX-512 and head_dim 32/64/128/256 a job runs the
// wide path (`attend_avx512`), with AVX2 and a head_dim that is a multiple of 8 up to 512 its 8-lane form
// (`attend_avx2`), else the portable loops (`dot` from simd_dot.h, whatever the target).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "fp8.h"
#include "cpu_isa.h"
#include "steal_for.h"

// Whether the wide path prefetches the next chunk's keys and values (and the next job's first keys) into L2
// through the block table while it computes this chunk. bench/attention_prefetch.py turns it off and on in
// turn through paged_decode_prefetch: on Sapphire Rapids, whose 300 MB L3 holds every layer's cache, the
// prefetch still took whole bf16 decode steps from 41.7 to 34.4 ms at batch 32 and 18.4 to 16.9 at 8
// (attention_prefetch-20261127-225147), though perf blames ~25% of the kernel's samples on its loop.
static std::atomic<bool> decode_prefetch{true};

bool paged_decode_prefetch(bool on) { return decode_prefetch.exchange(on); }

// Whether a bf16 or fp8 cache goes through the vdpbf16ps passes where the level has them (avx512_bf16 and up),
// else the fp32 ones: bench/attention_switches.py times whole decode steps each way in turn
static std::atomic<bool> decode_bf16{true};

bool paged_decode_bf16(bool on) { return decode_bf16.exchange(on); }

#define BATON_IMPL "paged_decode_impl.h"
#include "isa_variants.h"

void paged_decode(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor block_tables, torch::Tensor rows, torch::Tensor row_seq, torch::Tensor row_pos,
                  double scale, int64_t window) {
  active_kernels().paged_decode(std::move(out), std::move(query), std::move(k_cache), std::move(v_cache),
                                std::move(block_tables), std::move(rows), std::move(row_seq), std::move(row_pos),
                                scale, window);
}

TORCH_LIBRARY_FRAGMENT(baton_cpu, m) {
  m.def("paged_decode(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor rows, Tensor row_seq, Tensor row_pos, float scale, int window) -> ()");
  m.def("paged_decode_prefetch(bool on) -> bool", &paged_decode_prefetch);
  m.def("paged_decode_bf16(bool on) -> bool", &paged_decode_bf16);
}
TORCH_LIBRARY_IMPL(baton_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
