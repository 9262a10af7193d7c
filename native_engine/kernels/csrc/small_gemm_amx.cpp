// The small-M GEMM on AMX (see small_gemm.cpp for the layout). A tile multiply is 16 rows x 16
// columns x 32 k, and the packing is already the weight tile's layout: 16 k-pair lines of 64
// bytes, contiguous. x is copied once per call, zero-padded to whole tiles (16 rows, 32 k), so
// one tile shape serves every M and a pad never holds garbage (a NaN times a padded zero weight
// would be NaN). Tiles 0-3 accumulate four blocks, 4 holds x, 5-7 the weights in turn (three,
// so that a load need not wait for the multiply before last to let go of its tile).
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "small_gemm.h"

namespace pdserve::gemm {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
namespace {

constexpr int kTileRows = 16;
constexpr int64_t kPrefetchChunks = 2;  // weight tiles ahead in each block's stream (2 KiB)

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

TileConfig tile_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = kTileRows;
  }
  return cfg;
}

// Block J's weights for chunk c into tile BT, multiplied into accumulator J (the tile
// intrinsics take register numbers as literals).
#define PDSERVE_AMX_BLOCK(J, BT)                           \
  _tile_loadd(BT, w[J] + c * kTilePairs * kBlockCols, 64); \
  _tile_dpbf16ps(J, 4, BT)

// 16 rows (from row0) x NB blocks of y, over all of K; scratch holds NB C tiles.
template <int NB>
void tile(const Problem& pb, const uint16_t* xpad, int64_t ldxp, int64_t row0, int64_t block0,
          float* scratch) {
  const uint32_t* w[4];
  for (int j = 0; j < NB; ++j) w[j] = pb.block(block0 + j);
  _tile_zero(0);
  if (NB > 1) _tile_zero(1);
  if (NB > 2) _tile_zero(2);
  if (NB > 3) _tile_zero(3);
  const uint16_t* x = xpad + row0 * ldxp;
  for (int64_t c = 0; c < pb.k2 / kTilePairs; ++c) {
    for (int j = 0; j < NB; ++j) {
      const auto* ahead = reinterpret_cast<const char*>(
          w[j] + (c + kPrefetchChunks) * kTilePairs * kBlockCols);
      for (int line = 0; line < kTilePairs; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
    }
    _tile_loadd(4, x + c * 2 * kTilePairs, ldxp * 2);
    PDSERVE_AMX_BLOCK(0, 5);
    if (NB > 1) { PDSERVE_AMX_BLOCK(1, 6); }
    if (NB > 2) { PDSERVE_AMX_BLOCK(2, 7); }
    if (NB > 3) { PDSERVE_AMX_BLOCK(3, 5); }
  }
  _tile_stored(0, scratch, 64);
  if (NB > 1) _tile_stored(1, scratch + 256, 64);
  if (NB > 2) _tile_stored(2, scratch + 512, 64);
  if (NB > 3) _tile_stored(3, scratch + 768, 64);
  const int64_t rows = std::min<int64_t>(kTileRows, pb.m - row0);
  for (int j = 0; j < NB; ++j)
    for (int64_t i = 0; i < rows; ++i)
      store16(pb, _mm512_loadu_ps(scratch + j * 256 + i * 16), row0 + i,
              (block0 + j) * kBlockCols);
}

#undef PDSERVE_AMX_BLOCK

}  // namespace

void gemm_amx(const Problem& pb) {
  const int64_t rows = (pb.m + kTileRows - 1) / kTileRows * kTileRows;
  const int64_t ldxp = 2 * pb.k2;
  thread_local std::vector<uint16_t> xpad;  // the caller's thread's; kept to spare a malloc
  xpad.assign(rows * ldxp, 0);
  uint16_t* const xp = xpad.data();  // a worker would see its own thread_local: pass this
  for (int64_t i = 0; i < pb.m; ++i)
    std::memcpy(xp + i * ldxp, pb.x + i * pb.ldx, pb.k * sizeof(uint16_t));
  at::parallel_for(0, pb.n / kBlockCols, 1, [&](int64_t begin, int64_t end) {
    const TileConfig cfg = tile_config();
    _tile_loadconfig(&cfg);  // per thread: the tile state is the thread's
    alignas(64) float scratch[4 * 256];
    for (int64_t b = begin; b < end; b += 4) {
      const int64_t nb = std::min<int64_t>(4, end - b);
      for (int64_t r = 0; r < pb.m; r += kTileRows) {
        switch (nb) {
          case 1: tile<1>(pb, xp, ldxp, r, b, scratch); break;
          case 2: tile<2>(pb, xp, ldxp, r, b, scratch); break;
          case 3: tile<3>(pb, xp, ldxp, r, b, scratch); break;
          default: tile<4>(pb, xp, ldxp, r, b, scratch); break;
        }
      }
    }
    _tile_release();
  });
}
#else
void gemm_amx(const Problem&) {}
#endif

}  // namespace pdserve::gemm
