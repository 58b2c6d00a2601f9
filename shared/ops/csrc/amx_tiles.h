// AMX's tile configuration (the 64-byte block LDTILECFG reads), for the kernels with tile paths
// (gemv_bf16_impl.h). Tiles are per thread: each thread that runs tile instructions loads a
// configuration first and releases its tiles after (TILERELEASE), so the kernel saves no tile state at a
// context switch.
#pragma once

#include <cstdint>

constexpr int64_t kTileRows = 16;      // rows of every tile here
constexpr int64_t kTileRowBytes = 64;  // the most a tile row holds

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row, per tile
  uint8_t rows[16] = {};
  // tile t: `rows` rows of `bytes` bytes
  void set(int t, int rows_, int bytes) {
    rows[t] = static_cast<uint8_t>(rows_);
    colsb[t] = static_cast<uint16_t>(bytes);
  }
};
