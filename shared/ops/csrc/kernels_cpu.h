// The CPU kernels' entry points, for C++ callers (decoder_layers_cpu.cpp) that run them without going
// through Python. Each is defined, and registered under torch.ops.baton_cpu, in the .cpp named beside it.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <tuple>

#include "cpu_isa.h"

// gemv_cpu.cpp
torch::Tensor gemv(torch::Tensor x, torch::Tensor packed, int64_t out_features, int64_t k_block);
// gemv_bf16_cpu.cpp
torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor packed, int64_t out_features);
// qgemv_cpu.cpp
torch::Tensor qgemv(torch::Tensor x, torch::Tensor packed, int64_t out_features);
// w8a8_cpu.cpp
torch::Tensor w8a8(torch::Tensor x, torch::Tensor packed, int64_t out_features);
// silu_mul(w8a8(x, packed, out_features)), one pass for a prompt chunk's rows where gate and up are whole panels
torch::Tensor w8a8_silu(torch::Tensor x, torch::Tensor packed, int64_t out_features);
// norm_rope_cpu.cpp
torch::Tensor rms_norm_rows(torch::Tensor x, torch::Tensor weight, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm_rows(torch::Tensor x, torch::Tensor delta,
                                                           torch::Tensor weight, double eps);
void rope_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin);
// silu_mul_cpu.cpp
torch::Tensor silu_mul(torch::Tensor gate_up);
// the form of SiluColsFn (cpu_isa.h) that torch's own silu runs on this CPU (j0 a multiple of 16)
SiluColsFn silu_mul_cols();
// gemv_bf16_cpu.cpp: silu_mul(gemv_bf16(x, packed, out_features)), one pass on the amx tiles or for a prompt
// chunk's rows, where gate and up are whole panels
torch::Tensor gemv_bf16_silu(torch::Tensor x, torch::Tensor packed, int64_t out_features);
// write_kv_cpu.cpp
void write_kv_(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor key, torch::Tensor value,
               torch::Tensor slot_mapping);
// paged_decode_cpu.cpp
void paged_decode(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor block_tables, torch::Tensor rows, torch::Tensor row_seq, torch::Tensor row_pos,
                  double scale, int64_t window);
