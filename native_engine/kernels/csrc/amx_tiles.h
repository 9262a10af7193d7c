// AMX's tile configuration as every kernel here uses it: palette 1, all eight tiles 16 rows of
// 64 bytes (one bf16 or fp32 tile shape). Tile state is per thread: each thread of a parallel
// region configures it before its first tile instruction and releases it after its last.
#pragma once

#if defined(__AMX_TILE__)
#include <immintrin.h>

#include <cstdint>

namespace pdserve {

inline void configure_tiles() {
  struct alignas(64) {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace pdserve
#endif
