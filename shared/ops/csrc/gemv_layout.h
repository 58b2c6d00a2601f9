// The GEMV kernels' weight layout, shared by the fp32 (gemv_cpu.cpp) and bf16 (gemv_bf16_cpu.cpp) forms.
#pragma once

#include <cstdint>

// Outputs per panel: four AVX2 registers (two AVX-512 ones) of fp32 partial sums per row, enough independent
// FMA chains to cover the FMA latency at one row.
constexpr int64_t kGemvLanes = 32;
