// The CPU kernels' dispatch table by instruction set.
//
// The library is compiled for the baseline of its architecture (x86-64: no AVX), and each kernel that gains
// from wider vectors or newer instructions is compiled again for each instruction set inside a
// `#pragma GCC target` region (`isa_variants.h` includes its *_impl.h once per level, each in its own
// namespace). So one build holds every path, and any path the CPU runs can be picked and tested on it:
//
//   level         instructions it needs                       what it adds
//   portable      none (plain loops)                           every kernel, for any CPU
//   avx2          AVX2, FMA, F16C                              256-bit fp32 GEMV and attention (bf16 and fp8
//                                                              caches widened), vpmaddubsw quantized GEMV and W8A8
//   avx512        AVX-512 F/BW/VL/DQ                           512-bit paths, 8-row GEMV passes with prefetch
//   avx512_bf16   + AVX512-BF16, AVX512-VNNI                   vdpbf16ps bf16 GEMV and attention over a bf16 or
//                                                              fp8 cache, vpdpbusd quantized GEMV and W8A8
//   amx           + AMX-TILE, AMX-BF16, AMX-INT8               TDPBF16PS bf16 GEMV (tiles at every row count)
//
// Levels are ordered: each needs what the one above it needs, and a level's table takes the kernels of the
// levels below where it brings none of its own. The best level the CPU and OS support is picked when the
// library loads; `set_isa` picks another (tests, benchmarks), refusing one the CPU cannot run.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <string>

enum class Isa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmx = 4 };

// Which level a kernel's variant was compiled for, as a number the preprocessor can compare (isa_variants.h
// defines BATON_ISA to one of these before each inclusion of an *_impl.h).
#define BATON_ISA_PORTABLE 0
#define BATON_ISA_AVX2 1
#define BATON_ISA_AVX512 2
#define BATON_ISA_AVX512_BF16 3
#define BATON_ISA_AMX 4

using GemvFn = torch::Tensor (*)(torch::Tensor x, torch::Tensor packed, int64_t out_features, int64_t k_block);
// Rows of x quantized to int8 per block of 32 (qgemv_cpu.cpp): codes, per block the scale and the scale times
// the codes' sum, and per 16 codes their integer sum (Q6_K's offset of 32 needs it)
struct QRows {
  const int8_t* codes;
  int64_t ld_codes;
  const float* scales;
  const float* sums;
  int64_t ld_blocks;
  const int32_t* sums16;  // [rows, K / 16]: ld_blocks * 2 apart
  QRows offset(int64_t rows) const {
    return {codes + rows * ld_codes, ld_codes, scales + rows * ld_blocks, sums + rows * ld_blocks, ld_blocks,
            sums16 + rows * 2 * ld_blocks};
  }
};
// units: blocks or super-blocks a panel has (qgemv_layout.h); format: a QFormat
using QgemvFn = void (*)(const QRows& x, int64_t M, const uint8_t* packed, int64_t panels, int64_t units,
                         int64_t N, int64_t format, float* y);
// silu(gate) * up of elements [j0, j0 + n) of a row I wide, gate, up and out pointing at element j0, with
// silu_mul's bits (silu_mul_cpu.cpp's silu_mul_cols): a GEMM's epilogue
using SiluColsFn = void (*)(const float* g, const float* u, float* o, int64_t j0, int64_t n, int64_t I);
// y [M, N]; with `silu`, a gate_up weight's silu(gate) * up, y [M, N / 2] (gemv_bf16_impl.h)
using GemvBf16Fn = torch::Tensor (*)(torch::Tensor x, torch::Tensor packed, int64_t out_features, SiluColsFn silu);
// x [M, K] fp32 rows, packed by w8a8_pack, y [M, N] (w8a8_cpu.cpp); with `silu`, a gate_up weight's
// silu(gate) * up, y [M, N / 2]
using W8a8Fn = void (*)(const float* x, int64_t M, int64_t K, const int8_t* packed, int64_t panels, int64_t N,
                        float* y, SiluColsFn silu);
using PagedDecodeFn = void (*)(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor block_tables, torch::Tensor rows, torch::Tensor row_seq,
                               torch::Tensor row_pos, double scale, int64_t window);
using PrefillAttentionFn = void (*)(torch::Tensor out, torch::Tensor query, torch::Tensor key, torch::Tensor value,
                                   double scale, int64_t window);

struct KernelTable {
  Isa isa;
  GemvFn gemv_f32;              // gemv_cpu.cpp
  GemvBf16Fn gemv_bf16;         // gemv_bf16_cpu.cpp
  PagedDecodeFn paged_decode;   // paged_decode_cpu.cpp (fp32 or bf16 KV)
  QgemvFn qgemv_rows;           // qgemv_cpu.cpp (GGUF block and super-block formats)
  W8a8Fn w8a8_rows;             // w8a8_cpu.cpp (int8 per channel, rows quantized per block of 32)
  PrefillAttentionFn prefill_attention;  // prefill_attention_cpu.cpp (a prompt chunk, causal)
};

// The table of the level picked (the best one supported, unless set_isa chose another).
const KernelTable& active_kernels();
const char* isa_name(Isa isa);

// One variant per level, each defined in the kernel's .cpp (namespace = the level's name).
#define BATON_DECLARE_VARIANTS(decl) \
  namespace portable { decl; }       \
  namespace avx2 { decl; }           \
  namespace avx512 { decl; }         \
  namespace avx512_bf16 { decl; }

BATON_DECLARE_VARIANTS(torch::Tensor gemv_f32(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                                              int64_t k_block))
BATON_DECLARE_VARIANTS(void paged_decode(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache,
                                         torch::Tensor v_cache, torch::Tensor block_tables, torch::Tensor rows,
                                         torch::Tensor row_seq, torch::Tensor row_pos, double scale,
                                         int64_t window))
BATON_DECLARE_VARIANTS(void prefill_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key,
                                              torch::Tensor value, double scale, int64_t window))
BATON_DECLARE_VARIANTS(torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                                               SiluColsFn silu))
BATON_DECLARE_VARIANTS(void w8a8_rows(const float* x, int64_t M, int64_t K, const int8_t* packed, int64_t panels,
                                      int64_t N, float* y, SiluColsFn silu))
BATON_DECLARE_VARIANTS(void qgemv_rows(const QRows& x, int64_t M, const uint8_t* packed, int64_t panels,
                                       int64_t units, int64_t N, int64_t format, float* y))

// The kernels with a tile path of their own at the amx level (isa_variants.h's BATON_IMPL_AMX)
namespace amx {
torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor packed, int64_t out_features, SiluColsFn silu);
}  // namespace amx
