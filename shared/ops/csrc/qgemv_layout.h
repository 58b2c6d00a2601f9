// The quantized GEMV's weight layout (qgemv_cpu.cpp), shared by its packer and its loops.
//
// A weight is stored as u8 codes c with, per block of kQBlock inputs of each output, a scale d and an
// offset m (fp16): w = d * c + m. Every block format the packaged GGUF files use maps onto that without
// touching a code's value: Q4_0 (c = q, m = -8d), Q4_1 (its own d and m), Q8_0 (c = q + 128, m = -128d),
// and int8 per channel (Q8_0's form with one d per output row).
//
//   packed [panels, K / kQBlock, block_bytes] u8; a panel is kQLanes outputs, a block of it:
//     codes   kQBlock / 4 quads of kQLanes x 4 codes (output lane l, inputs 4q .. 4q + 3 at value 4l + j):
//             4-bit: 32 bytes a quad, value v in byte v % 32, low nibble for v < 32, high for v >= 32;
//             8-bit: 64 bytes a quad, value v in byte v
//     d       kQLanes fp16
//     m       kQLanes fp16
//
// A quad is one operand of vpdpbusd (u8 codes x s8 activations, four products summed per int32 lane), so
// a block's dot products with an int8-quantized activation block are 8 instructions for 16 outputs.
#pragma once

#include <cstdint>

constexpr int64_t kQLanes = 16;
constexpr int64_t kQBlock = 32;
constexpr int64_t kQQuads = kQBlock / 4;

constexpr int64_t q_code_bytes(int64_t bits) { return kQLanes * kQBlock * bits / 8; }
constexpr int64_t q_block_bytes(int64_t bits) { return q_code_bytes(bits) + 2 * kQLanes * 2; }
