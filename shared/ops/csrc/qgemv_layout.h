// The quantized GEMV's weight layouts (qgemv_cpu.cpp), shared by its packers and its loops.
//
// Block formats: u8 codes c with, per block of kQBlock inputs of each output, a scale d and an offset m (fp16):
// w = d * c + m. Q4_0 (c = q, m = -8d), Q4_1 (its own d and m), Q5_0 (c = q, m = -16d), Q8_0 (c = q + 128,
// m = -128d) and int8 per channel (Q8_0's form with one d per output row) all map onto it without touching a
// code's value.
//
//   packed [panels, K / kQBlock, block_bytes] u8; a panel is kQLanes outputs, a block of it:
//     codes   kQBlock / 4 quads of kQLanes x 4 codes (output lane l, inputs 4q .. 4q + 3 at value 4l + j):
//             4-bit: 32 bytes a quad, value v in byte v % 32, low nibble for v < 32, high for v >= 32;
//             5-bit: the 4-bit quad, then 8 bytes: bit v of that u64 is bit 4 of value v;
//             8-bit: 64 bytes a quad, value v in byte v
//     d       kQLanes fp16
//     m       kQLanes fp16
//
// K-quant formats (GGUF's super-blocks of kQSuper = 256 inputs, as the file holds them):
//   Q4_K   w = d * sc[j] * c - dmin * mn[j], 4-bit c, 6-bit sc and mn per sub-block j of 32
//   Q6_K   w = d * sc[j] * (c - 32), 6-bit c, int8 sc per sub-block j of 16
//
//   packed [panels, K / kQSuper, super_bytes] u8; a super-block of a panel:
//     Q4_K   8 x the 4-bit codes of a block (256 B each), sc [8][kQLanes] u8, mn [8][kQLanes] u8,
//            d kQLanes fp16, dmin kQLanes fp16
//     Q6_K   8 x (8 quads of: the 4-bit quad's 32 bytes of low nibbles, then 16 bytes of high pairs: bits
//            2 (v / 16) .. 2 (v / 16) + 1 of byte v % 16 are bits 4-5 of value v), sc [16][kQLanes] int8,
//            d kQLanes fp16
//
// A quad is one operand of vpdpbusd (u8 codes x s8 activations, four products summed per int32 lane), so a
// block's dot products with an int8-quantized activation block are 8 instructions for 16 outputs. Every
// format has its own bytes per block, which is how qgemv tells them apart (q_format_of).
#pragma once

#include <cstdint>

constexpr int64_t kQLanes = 16;
constexpr int64_t kQBlock = 32;
constexpr int64_t kQQuads = kQBlock / 4;
constexpr int64_t kQSuper = 256;
constexpr int64_t kQSubBlocks = kQSuper / kQBlock;

// kB4 / kB5 / kB8: the block formats by code width; kQ4K / kQ6K: the super-block formats
enum QFormat : int { kB4 = 0, kB5 = 1, kB8 = 2, kQ4K = 3, kQ6K = 4 };

constexpr int64_t q_code_bytes(int64_t bits) { return kQLanes * kQBlock * bits / 8; }
constexpr int64_t q_block_bytes(int64_t bits) { return q_code_bytes(bits) + 2 * kQLanes * 2; }
// bytes of a quad's codes
constexpr int64_t q_quad_bytes(int64_t bits) { return kQLanes * 4 * bits / 8; }
constexpr int64_t kQ4KBytes = kQSubBlocks * q_code_bytes(4) + 2 * kQSubBlocks * kQLanes + 2 * kQLanes * 2;
constexpr int64_t kQ6KBytes = kQSubBlocks * q_code_bytes(6) + 2 * kQSubBlocks * kQLanes + kQLanes * 2;

// bytes of one unit (block or super-block) of a panel, and the inputs a unit spans
constexpr int64_t q_unit_bytes(QFormat f) {
  return f == kB4 ? q_block_bytes(4) : f == kB5 ? q_block_bytes(5) : f == kB8 ? q_block_bytes(8)
       : f == kQ4K ? kQ4KBytes : kQ6KBytes;
}
constexpr int64_t q_unit_inputs(QFormat f) { return f >= kQ4K ? kQSuper : kQBlock; }

// A code of a block's codes (`codes`: its first byte) at output lane l, input k (< kQBlock), read and written
// as the layout above stores it (the packer and the portable loops; the vector loops unpack whole quads).
inline uint8_t q_code_get(const uint8_t* codes, int bits, int64_t l, int64_t k) {
  const int64_t q = k / 4, v = l * 4 + k % 4;
  if (bits == 8) return codes[q * 64 + v];
  const uint8_t* quad = codes + q * q_quad_bytes(bits);
  const uint8_t nibble = v < 32 ? quad[v] & 0x0f : quad[v - 32] >> 4;
  if (bits == 4) return nibble;
  if (bits == 5) return nibble | static_cast<uint8_t>(((quad[32 + v / 8] >> (v % 8)) & 1) << 4);
  return nibble | static_cast<uint8_t>(((quad[32 + v % 16] >> (2 * (v / 16))) & 3) << 4);
}

// codes must be zeroed first: each code ORs its bits in
inline void q_code_put(uint8_t* codes, int bits, int64_t l, int64_t k, uint8_t code) {
  const int64_t q = k / 4, v = l * 4 + k % 4;
  if (bits == 8) {
    codes[q * 64 + v] = code;
    return;
  }
  uint8_t* quad = codes + q * q_quad_bytes(bits);
  quad[v % 32] |= v < 32 ? (code & 0x0f) : static_cast<uint8_t>((code & 0x0f) << 4);
  if (bits == 5) quad[32 + v / 8] |= static_cast<uint8_t>(((code >> 4) & 1) << (v % 8));
  if (bits == 6) quad[32 + v % 16] |= static_cast<uint8_t>(((code >> 4) & 3) << (2 * (v / 16)));
}

// the format whose unit has this many bytes, or -1
inline int q_format_of(int64_t unit_bytes) {
  for (int f = kB4; f <= kQ6K; ++f)
    if (q_unit_bytes(static_cast<QFormat>(f)) == unit_bytes) return f;
  return -1;
}
