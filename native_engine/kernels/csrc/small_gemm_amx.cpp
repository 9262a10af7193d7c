// The small-M GEMM on AMX (see small_gemm.cpp for the layout). A tile multiply is 16 rows x 16
// columns x 32 k, and the packing is already the weight tile's layout: 16 k-pair lines of 64
// bytes, contiguous. x is copied once per call, zero-padded to whole tiles (16 rows, 32 k), so
// one tile shape serves every M and a pad never holds garbage (a NaN times a padded zero weight
// would be NaN). Tiles 0-3 accumulate four blocks, 4 holds x, 5-7 the weights in turn (three,
// so that a load need not wait for the multiply before last to let go of its tile).
//
// Gated (pb.silu set: the MLP's gate_up projection with SiLU x up after it), a unit of output
// is a gate block and its up block, N / 32 blocks apart in the packing, multiplied side by
// side; their accumulators are rounded to bf16 as y's would be and combined as silu_mul
// combines them, so y is the unfused ops' bits, but the [M, N] product is never written or
// read back.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "silu.h"
#include "small_gemm.h"

namespace pdserve::gemm {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
namespace {

constexpr int kTileRows = 16;
constexpr int64_t kPrefetchChunks = 2;  // weight tiles ahead in each block's stream (2 KiB)
// Above this M, panels (below); at or under, each block's weights stream past the rows. Past
// one tile of rows the stream re-reads each block from L2 per 16 rows, where a panel loads
// each weight tile once for 32 rows (SmolLM2's shapes, cold weights: M = 32 at 21.5 GB/s
// against 19.8 streamed, M = 40 at 16.9 against 16.3; M <= 16 streams at ~26).
constexpr int64_t kStreamMaxRows = 16;

// Output units: blocks of y's 16 columns, each one weight block, or gated a gate block and its
// up block.
int64_t units(const Problem& pb) { return pb.ldy() / kBlockCols; }

// The weight blocks of units [u, u + count), in the order their tiles are multiplied (gated:
// gate, up, gate, up ...); returns how many.
int unit_blocks(const Problem& pb, int64_t u, int64_t count, int64_t* blocks) {
  if (pb.silu == nullptr) {
    for (int64_t i = 0; i < count; ++i) blocks[i] = u + i;
    return static_cast<int>(count);
  }
  for (int64_t i = 0; i < count; ++i) {
    blocks[2 * i] = u + i;
    blocks[2 * i + 1] = u + i + units(pb);
  }
  return static_cast<int>(2 * count);
}

// The accumulators of a group of 16 rows from row0 (`rows` valid), scratch tile j (16 x 16
// fp32) for weight block blocks[j], into y: each block to its columns, or gated, tiles 2i and
// 2i + 1 (a gate block and its up block) to the gate block's columns.
void store_tiles(const Problem& pb, const float* scratch, int nb, const int64_t* blocks,
                 int64_t row0, int64_t rows) {
  if (pb.silu == nullptr) {
    for (int j = 0; j < nb; ++j)
      for (int64_t i = 0; i < rows; ++i)
        store16(pb, _mm512_loadu_ps(scratch + j * 256 + i * 16), row0 + i,
                blocks[j] * kBlockCols);
    return;
  }
  const int64_t ldy = pb.ldy();
  for (int j = 0; j < nb; j += 2) {
    const int64_t col = blocks[j] * kBlockCols;
    for (int64_t i = 0; i < rows; ++i) {
      const __m256i gate = round16(pb, _mm512_loadu_ps(scratch + j * 256 + i * 16), col);
      const __m256i up =
          round16(pb, _mm512_loadu_ps(scratch + (j + 1) * 256 + i * 16), col + ldy);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb.y + (row0 + i) * ldy + col),
                          silu_mul_bf16x16(gate, up, pb.silu));
    }
  }
}


// Block J's weights for chunk c into tile BT, multiplied into accumulator J (the tile
// intrinsics take register numbers as literals).
#define PDSERVE_AMX_BLOCK(J, BT)                           \
  _tile_loadd(BT, w[J] + c * kTilePairs * kBlockCols, 64); \
  _tile_dpbf16ps(J, 4, BT)

// 16 rows (from row0) x NB weight blocks, over all of K; scratch holds NB C tiles.
template <int NB>
void tile(const Problem& pb, const uint16_t* xpad, int64_t ldxp, int64_t row0,
          const int64_t* blocks, float* scratch) {
  const uint32_t* w[4];
  for (int j = 0; j < NB; ++j) w[j] = pb.block(blocks[j]);
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
  store_tiles(pb, scratch, NB, blocks, row0, std::min<int64_t>(kTileRows, pb.m - row0));
}

#undef PDSERVE_AMX_BLOCK

// ---- Large M (prefill): panels --------------------------------------------------------------
// Streaming each block's weights past 16 rows at a time re-reads them from L2 for every 16
// rows; at prefill sizes that, not the multiplies, is the time (2.8x oneDNN at M = 2048). Here
// threads split the rows, and a 32 x 32 output panel is four accumulator tiles (0-3) fed by
// two x tiles (4, 5) and two weight tiles (6, 7) a k-step: each loaded tile is used twice.
// Every accumulator still takes the same k-steps in the same order from zero, so each output
// element is the same fp32 sum, bit for bit, as on the streaming path: a row's result does not
// depend on M on either side of the switch.
//
// A panel's x tiles are loaded with the streaming hint (TILELOADDT1): each is used by that
// k-step's two multiplies and not again until the next block pair, and, loaded as usual, they
// pushed the block pair (36 KiB at K = 576) out of L1, so every weight tile came from L2
// (N = 3072, K = 576, M = 2048: 1.66x oneDNN's time, against 1.2x with the hint).

// x rows as AMX reads them: 64-byte tile rows at a byte stride, in place where K fills whole
// tiles; otherwise (and for a last group of fewer than 16 rows) a zero-padded copy.
struct XRows {
  const uint16_t* x;  // row r's k-step c at x + r * ld + 32 * c
  int64_t ld;
};

#define PDSERVE_AMX_PANEL_STEP(RA, NB)                                         \
  _tile_stream_loadd(4, a0 + 32 * c, lda0 * 2);                                \
  if (RA > 1) _tile_stream_loadd(5, a1 + 32 * c, lda1 * 2);                    \
  _tile_loadd(6, w0 + c * kTilePairs * kBlockCols, 64);                        \
  if (NB > 1) _tile_loadd(7, w1 + c * kTilePairs * kBlockCols, 64);            \
  _tile_dpbf16ps(0, 4, 6);                                                     \
  if (NB > 1) _tile_dpbf16ps(1, 4, 7);                                         \
  if (RA > 1) _tile_dpbf16ps(2, 5, 6);                                         \
  if (RA > 1 && NB > 1) _tile_dpbf16ps(3, 5, 7)

// Rows (16 RA of them from a0 / a1, `rows` valid) x weight blocks blocks[0 .. NB), all of K.
template <int RA, int NB>
void panel(const Problem& pb, const uint16_t* a0, int64_t lda0, const uint16_t* a1, int64_t lda1,
           int64_t row0, int64_t rows, const int64_t* blocks, bool fetch, float* scratch) {
  const uint32_t* w0 = pb.block(blocks[0]);
  const uint32_t* w1 = NB > 1 ? pb.block(blocks[1]) : w0;
  _tile_zero(0);
  if (NB > 1) _tile_zero(1);
  if (RA > 1) _tile_zero(2);
  if (RA > 1 && NB > 1) _tile_zero(3);
  const int64_t steps = pb.k2 / kTilePairs;
  if (fetch) {
    for (int64_t c = 0; c < steps; ++c) {
      // The weights' next tiles, as the streaming path fetches them: cold weights otherwise
      // leave every tile load waiting on memory. Only the first panel of a block pair needs
      // them; later panels find the pair in cache.
      const int64_t next = (c + kPrefetchChunks) * kTilePairs * kBlockCols;
      const auto* ahead0 = reinterpret_cast<const char*>(w0 + next);
      const auto* ahead1 = reinterpret_cast<const char*>(w1 + next);
      for (int line = 0; line < kTilePairs; ++line) {
        _mm_prefetch(ahead0 + 64 * line, _MM_HINT_T0);
        if (NB > 1) _mm_prefetch(ahead1 + 64 * line, _MM_HINT_T0);
      }
      PDSERVE_AMX_PANEL_STEP(RA, NB);
    }
  } else {
    for (int64_t c = 0; c < steps; ++c) {
      PDSERVE_AMX_PANEL_STEP(RA, NB);
    }
  }
  _tile_stored(0, scratch, 64);
  if (NB > 1) _tile_stored(1, scratch + 256, 64);
  if (RA > 1) _tile_stored(2, scratch + 512, 64);
  if (RA > 1 && NB > 1) _tile_stored(3, scratch + 768, 64);
  for (int ra = 0; ra < RA; ++ra)
    store_tiles(pb, scratch + 2 * ra * 256, NB, blocks, row0 + ra * kTileRows,
                std::min<int64_t>(kTileRows, rows - ra * kTileRows));
}

#undef PDSERVE_AMX_PANEL_STEP

// Where each group of 16 x rows lies for the tiles: in place where K fills whole tiles, else
// (and for a last group of fewer than 16 rows) in a zero-padded copy, made once per call.
struct XGroups {
  const Problem& pb;
  int64_t ldp;        // a padded row: whole tiles of k
  int64_t copy_from;  // rows from here on are read from pad
  const uint16_t* pad;
  XRows at(int64_t r) const {
    return r < copy_from ? XRows{pb.x + r * pb.ldx, pb.ldx}
                         : XRows{pad + (r - copy_from) * ldp, ldp};
  }
};

// Rows [r0, r1) (r0 a multiple of 16) x block pairs [p0, p1) (a pair: two units' blocks, or
// gated one unit's gate and up blocks). x rows of one row block stay in L2 (1 MiB of them)
// while the weight panels pass over them: the weights are read once per row block.
void panels(const Problem& pb, const XGroups& x, int64_t r0, int64_t r1, int64_t p0, int64_t p1) {
  constexpr int64_t kRowBlockBytes = 1 << 20;
  constexpr int64_t kPanelRows = 2 * kTileRows;
  const int64_t row_block =
      std::max<int64_t>(kPanelRows, kRowBlockBytes / (2 * x.ldp) / kPanelRows * kPanelRows);
  alignas(64) float scratch[4 * 256];
  // A pair is two units' blocks, or gated one unit's (its gate and up blocks).
  const int64_t per_pair = pb.silu == nullptr ? 2 : 1;
  for (int64_t rb = r0; rb < r1; rb += row_block) {
    const int64_t rb_end = std::min(r1, rb + row_block);
    for (int64_t p = p0; p < p1; ++p) {
      int64_t blocks[2];
      const int64_t u = p * per_pair;
      const bool two = unit_blocks(pb, u, std::min(per_pair, units(pb) - u), blocks) == 2;
      for (int64_t r = rb; r < rb_end; r += kPanelRows) {
        const bool fetch = r == rb;
        const XRows a0 = x.at(r);
        const int64_t rows = std::min<int64_t>(kPanelRows, rb_end - r);
        if (rows > kTileRows) {
          const XRows a1 = x.at(r + kTileRows);
          if (two) panel<2, 2>(pb, a0.x, a0.ld, a1.x, a1.ld, r, rows, blocks, fetch, scratch);
          else panel<2, 1>(pb, a0.x, a0.ld, a1.x, a1.ld, r, rows, blocks, fetch, scratch);
        } else if (two) {
          panel<1, 2>(pb, a0.x, a0.ld, a0.x, a0.ld, r, rows, blocks, fetch, scratch);
        } else {
          panel<1, 1>(pb, a0.x, a0.ld, a0.x, a0.ld, r, rows, blocks, fetch, scratch);
        }
      }
    }
  }
}

// To 128 rows threads split the weight panels (block pairs), as the streaming path splits
// blocks: each weight is read by one thread (cold weights at M = 64: 17 GB/s, against 12 with
// rows split). Above, they split the rows (at M = 256: 6.3 GB/s, against 4.7). Either way an
// element's sum is the same.
constexpr int64_t kSplitWeightsMaxRows = 128;

void gemm_amx_panels(const Problem& pb) {
  const int64_t ldp = 2 * pb.k2;
  const int64_t copy_from = pb.k == ldp ? pb.m / kTileRows * kTileRows : 0;
  thread_local std::vector<uint16_t> pad;  // the caller's thread's; workers get the pointer
  pad.assign((pb.m - copy_from + kTileRows - 1) / kTileRows * kTileRows * ldp, 0);
  for (int64_t r = copy_from; r < pb.m; ++r)
    std::memcpy(pad.data() + (r - copy_from) * ldp, pb.x + r * pb.ldx, pb.k * sizeof(uint16_t));
  const XGroups x{pb, ldp, copy_from, pad.data()};
  const int64_t pairs = pb.silu == nullptr ? (units(pb) + 1) / 2 : units(pb);
  const int64_t groups = (pb.m + kTileRows - 1) / kTileRows;
  const bool split_weights = pb.m <= kSplitWeightsMaxRows;
  at::parallel_for(0, split_weights ? pairs : groups, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();  // per thread: the tile state is the thread's
    if (split_weights) {
      panels(pb, x, 0, pb.m, begin, end);
    } else {
      panels(pb, x, begin * kTileRows, std::min(pb.m, end * kTileRows), 0, pairs);
    }
    _tile_release();
  });
}

}  // namespace

void gemm_amx(const Problem& pb) {
  if (pb.m > kStreamMaxRows) return gemm_amx_panels(pb);
  const int64_t rows = (pb.m + kTileRows - 1) / kTileRows * kTileRows;
  const int64_t ldxp = 2 * pb.k2;
  thread_local std::vector<uint16_t> xpad;  // the caller's thread's; kept to spare a malloc
  xpad.assign(rows * ldxp, 0);
  uint16_t* const xp = xpad.data();  // a worker would see its own thread_local: pass this
  for (int64_t i = 0; i < pb.m; ++i)
    std::memcpy(xp + i * ldxp, pb.x + i * pb.ldx, pb.k * sizeof(uint16_t));
  // Four weight blocks a pass: four units, or gated two.
  const int64_t per_pass = pb.silu == nullptr ? 4 : 2;
  at::parallel_for(0, units(pb), 1, [&](int64_t begin, int64_t end) {
    configure_tiles();  // per thread: the tile state is the thread's
    alignas(64) float scratch[4 * 256];
    for (int64_t u = begin; u < end; u += per_pass) {
      int64_t blocks[4];
      const int nb = unit_blocks(pb, u, std::min<int64_t>(per_pass, end - u), blocks);
      for (int64_t r = 0; r < pb.m; r += kTileRows) {
        switch (nb) {
          case 1: tile<1>(pb, xp, ldxp, r, blocks, scratch); break;
          case 2: tile<2>(pb, xp, ldxp, r, blocks, scratch); break;
          case 3: tile<3>(pb, xp, ldxp, r, blocks, scratch); break;
          default: tile<4>(pb, xp, ldxp, r, blocks, scratch); break;
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
