// AMX's tile configuration as every kernel here uses it: palette 1, all eight tiles 16 rows of
// 64 bytes (one bf16 or fp32 tile shape). Tile state is per thread: each thread of a parallel
// region configures it before its first tile instruction and releases it after its last.
#pragma once

#include <asm/prctl.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__AMX_TILE__)
#include <immintrin.h>
#endif

#include <cstdint>

namespace pdserve {

// Whether this CPU has AMX tiles with bf16 (and AVX512-BF16, which every kernel here uses
// beside them) and the kernel lets this process use the tile data state (asked once per
// process; every AMX kernel here checks it before its first tile op).
inline bool amx_permitted() {
  static const bool permitted = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1u, bf16 = (d >> 22) & 1u;
    constexpr int kXFeatureTileData = 18;
    return tile && bf16 && __builtin_cpu_supports("avx512bf16") &&
           syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, kXFeatureTileData) == 0;
  }();
  return permitted;
}

}  // namespace pdserve

#if defined(__AMX_TILE__)
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
