// The small-M GEMM's vector kernels (see small_gemm.cpp for the layouts). A tile is MR rows x
// NB blocks of y over all of K: the NB weight lines of a k (bf16: a k-pair) are loaded once
// and used by every row, the accumulators stay in registers for the whole of K.
//   - bf16 on AVX512-BF16: vdpbf16ps multiplies a line by the broadcast pair (x[2p], x[2p + 1]);
//   - bf16 on AVX2 + FMA (no bf16 hardware): the line's dwords are widened to fp32 in registers
//     (a shift gives the even k, a mask the odd one; bf16 is fp32's top half), two FMAs;
//   - fp32 on AVX-512F or AVX2 + FMA: one FMA per line and row, the broadcast x[k]. Both ISAs
//     compute y[r, c] as the same chain fma(x[k], w[k], acc) over k = 0..K-1, so they agree
//     bit for bit, at any M.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "bf16.h"
#include "small_gemm.h"

namespace pdserve::gemm {
namespace {

// Calls Tile<mr, nb>::run for runtime mr <= MR, nb <= NB (the compiler unrolls each).
template <template <int, int> class Tile, int MR, int NB, class P>
void run_tile(int mr, int nb, const P& pb, int64_t row0, int64_t block0) {
  if constexpr (MR > 1) {
    if (mr < MR) return run_tile<Tile, MR - 1, NB>(mr, nb, pb, row0, block0);
  }
  if constexpr (NB > 1) {
    if (nb < NB) return run_tile<Tile, MR, NB - 1>(mr, nb, pb, row0, block0);
  }
  Tile<MR, NB>::run(pb, row0, block0);
}

// Threads take contiguous block ranges (each reads its own sequential streams); within one,
// NB blocks at a time, every MR rows against them (the lines are in cache after the first).
// Rows go in chunks of kChunkRows, so at prefill sizes a chunk of x (<= 576 KiB at K = 1536,
// fp32) stays in L2 while the thread's blocks pass, not all of x once per NB blocks.
template <template <int, int> class Tile, int MR, int NB, class P>
void solve(const P& pb) {
  constexpr int64_t kChunkRows = 96;
  at::parallel_for(0, pb.n / kBlockCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < pb.m; r0 += kChunkRows) {
      const int64_t r1 = std::min(pb.m, r0 + kChunkRows);
      for (int64_t b = begin; b < end; b += NB) {
        const int nb = static_cast<int>(std::min<int64_t>(NB, end - b));
        for (int64_t r = r0; r < r1; r += MR) {
          const int mr = static_cast<int>(std::min<int64_t>(MR, r1 - r));
          run_tile<Tile, MR, NB>(mr, nb, pb, r, b);
        }
      }
    }
  });
}

// Line p + kPrefetchLines of a block's stream (dwords or floats: 16 a line).
template <class T>
inline void prefetch_line(const T* stream, int64_t p) {
  static_assert(sizeof(T) == 4);
  _mm_prefetch(reinterpret_cast<const char*>(stream + (p + kPrefetchLines) * kBlockCols),
               _MM_HINT_T0);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
template <int MR, int NB>
struct Avx512Bf16Tile {
  static void run(const Problem& pb, int64_t row0, int64_t block0) {
    __m512 acc[MR][NB];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
    const uint32_t* w[NB];
    for (int j = 0; j < NB; ++j) w[j] = pb.block(block0 + j);
    const int64_t full = pb.k / 2;  // pairs with both k's in x (K odd: the last has one)
    for (int64_t p = 0; p < pb.pairs; ++p) {
      __m512bh line[NB];
      for (int j = 0; j < NB; ++j) {
        prefetch_line(w[j], p);
        line[j] = (__m512bh)_mm512_loadu_si512(w[j] + p * kBlockCols);
      }
      for (int i = 0; i < MR; ++i) {
        const uint16_t* row = pb.x + (row0 + i) * pb.ldx;
        uint32_t pair = row[2 * p];
        if (p < full) std::memcpy(&pair, row + 2 * p, sizeof pair);
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, line[j]);
      }
    }
    for (int j = 0; j < NB; ++j)
      for (int i = 0; i < MR; ++i) store16(pb, acc[i][j], row0 + i, (block0 + j) * kBlockCols);
  }
};
#endif

#if defined(__AVX2__) && defined(__FMA__)
// A block is two 8-lane halves; 16 ymm registers hold 2 rows x 2 blocks and their operands.
template <int MR, int NB>
struct Avx2Tile {
  static void run(const Problem& pb, int64_t row0, int64_t block0) {
    __m256 acc[MR][NB][2];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NB; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
    const uint32_t* w[NB];
    for (int j = 0; j < NB; ++j) w[j] = pb.block(block0 + j);
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    for (int64_t p = 0; p < pb.pairs; ++p) {
      __m256 even[NB][2], odd[NB][2];
      for (int j = 0; j < NB; ++j) {
        prefetch_line(w[j], p);
        for (int h = 0; h < 2; ++h) {
          const __m256i d = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(w[j] + p * kBlockCols + 8 * h));
          even[j][h] = _mm256_castsi256_ps(_mm256_slli_epi32(d, 16));
          odd[j][h] = _mm256_castsi256_ps(_mm256_and_si256(d, high));
        }
      }
      for (int i = 0; i < MR; ++i) {
        const uint16_t* row = pb.x + (row0 + i) * pb.ldx;
        const __m256 x0 = _mm256_set1_ps(bf16_to_float(row[2 * p]));
        const __m256 x1 = _mm256_set1_ps(2 * p + 1 < pb.k ? bf16_to_float(row[2 * p + 1]) : 0.0f);
        for (int j = 0; j < NB; ++j)
          for (int h = 0; h < 2; ++h)
            acc[i][j][h] =
                _mm256_fmadd_ps(x1, odd[j][h], _mm256_fmadd_ps(x0, even[j][h], acc[i][j][h]));
      }
    }
    alignas(32) float lanes[8];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NB; ++j)
        for (int h = 0; h < 2; ++h) {
          _mm256_store_ps(lanes, acc[i][j][h]);
          const int64_t col = (block0 + j) * kBlockCols + 8 * h;
          uint16_t* out = pb.y + (row0 + i) * pb.n + col;
          for (int c = 0; c < 8; ++c) {
            const float bias = pb.bias != nullptr ? bf16_to_float(pb.bias[col + c]) : 0.0f;
            out[c] = float_to_bf16(lanes[c] + bias);
          }
        }
  }
};
#endif

// The fp32 tile is one template over each ISA's vector: kLanes floats and the ops it takes.
#if defined(__AVX512F__)
struct Zmm {
  using V = __m512;
  static constexpr int kLanes = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V set1(float f) { return _mm512_set1_ps(f); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
};
#endif

#if defined(__AVX2__) && defined(__FMA__)
struct Ymm {
  using V = __m256;
  static constexpr int kLanes = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V set1(float f) { return _mm256_set1_ps(f); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
};
#endif

// A block's 16 columns are kParts vectors; per k, a block's line is loaded once for all rows.
template <class Vec, int MR, int NB>
struct F32Tile {
  using V = typename Vec::V;
  static constexpr int kParts = static_cast<int>(kBlockCols) / Vec::kLanes;

  static void run(const ProblemF32& pb, int64_t row0, int64_t block0) {
    V acc[MR][NB][kParts];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NB; ++j)
        for (int h = 0; h < kParts; ++h) acc[i][j][h] = Vec::zero();
    const float* w[NB];
    for (int j = 0; j < NB; ++j) w[j] = pb.block(block0 + j);
    const float* x = pb.x + row0 * pb.ldx;
    for (int64_t k = 0; k < pb.k; ++k) {
      V line[NB][kParts];
      for (int j = 0; j < NB; ++j) {
        prefetch_line(w[j], k);
        for (int h = 0; h < kParts; ++h)
          line[j][h] = Vec::load(w[j] + k * kBlockCols + h * Vec::kLanes);
      }
      for (int i = 0; i < MR; ++i) {
        const V xv = Vec::set1(x[i * pb.ldx + k]);
        for (int j = 0; j < NB; ++j)
          for (int h = 0; h < kParts; ++h) acc[i][j][h] = Vec::fma(xv, line[j][h], acc[i][j][h]);
      }
    }
    for (int j = 0; j < NB; ++j)
      for (int h = 0; h < kParts; ++h) {
        const int64_t col = (block0 + j) * kBlockCols + h * Vec::kLanes;
        const V bias = pb.bias != nullptr ? Vec::load(pb.bias + col) : Vec::zero();
        for (int i = 0; i < MR; ++i)
          Vec::store(pb.y + (row0 + i) * pb.n + col, Vec::add(acc[i][j][h], bias));
      }
  }
};

#if defined(__AVX512F__)
template <int MR, int NB>
using Avx512F32Tile = F32Tile<Zmm, MR, NB>;
#endif
#if defined(__AVX2__) && defined(__FMA__)
template <int MR, int NB>
using Avx2F32Tile = F32Tile<Ymm, MR, NB>;
#endif

}  // namespace

#if defined(__AVX512F__)
// Up to 4 rows, one tile of 4 blocks (4 streams from memory at once); from 5, 8 rows x 3
// blocks, so 8 and 32 rows are whole tiles where 6 x 4 left a 2-row one re-reading its
// blocks. Either way an element is the same FMA chain.
void gemm_f32_avx512(const ProblemF32& pb) {
  if (pb.m <= 4) {
    solve<Avx512F32Tile, 4, 4>(pb);
  } else {
    solve<Avx512F32Tile, 8, 3>(pb);
  }
}
#else
void gemm_f32_avx512(const ProblemF32&) {}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// 16 ymm registers: 2 rows x 2 blocks keeps four FMA chains going for one row; from 5 rows,
// 6 rows x 1 block loads less per FMA (0.72x -> 0.85x oneDNN's AVX2 speed at 128-512 rows,
// 1.28x -> 1.10x at one row). Either way an element is the same FMA chain.
void gemm_f32_avx2(const ProblemF32& pb) {
  if (pb.m <= 4) {
    solve<Avx2F32Tile, 2, 2>(pb);
  } else {
    solve<Avx2F32Tile, 6, 1>(pb);
  }
}
#else
void gemm_f32_avx2(const ProblemF32&) {}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
void gemm_avx512bf16(const Problem& pb) { solve<Avx512Bf16Tile, 4, 4>(pb); }
#else
void gemm_avx512bf16(const Problem&) {}
#endif

#if defined(__AVX2__) && defined(__FMA__)
void gemm_avx2(const Problem& pb) { solve<Avx2Tile, 2, 2>(pb); }
#else
void gemm_avx2(const Problem&) {}
#endif

}  // namespace pdserve::gemm
