// The small-M GEMM's shared parts (see small_gemm.cpp): the packed layouts' constants, the
// problem one call solves (bf16 or fp32), and the kernel of each ISA.
#pragma once

#include <cstdint>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace pdserve::gemm {

constexpr int64_t kBlockCols = 16;     // output columns per packed block (one 64-byte line)
constexpr int64_t kTilePairs = 16;     // k-pairs per AMX tile (32 k): the packing pads K to it
constexpr int64_t kPrefetchLines = 8;  // lines ahead in each block's stream (512 bytes)

// kAvx2 serves both dtypes, kAvx512Bf16 and kAmx bf16, kAvx512 fp32 (the Python GemmIsa).
enum Isa : int64_t { kAuto = 0, kAvx2 = 1, kAvx512Bf16 = 2, kAmx = 3, kAvx512 = 4 };

struct Problem {
  const uint16_t* x;     // [M, K] bf16, row stride ldx
  int64_t ldx;
  const uint32_t* w;     // packed: [N / 16][k2][16] dwords, each two bf16 (k = 2p, 2p + 1)
  int64_t k2;            // k-pairs per block in the packing (padded to kTilePairs)
  int64_t pairs;         // k-pairs of K: (K + 1) / 2
  int64_t k;             // K
  const uint16_t* bias;  // [N] bf16, or nullptr
  uint16_t* y;           // [M, N] bf16, row-major
  int64_t n;             // N
  int64_t m;             // M
  // Gated (gemm_amx only): y is [M, N / 2], silu(gate) * up of the halves (gate |
  // up) of the product, each rounded as the unfused ops round it; this is silu.h's table.
  const uint16_t* silu = nullptr;
  // Block b's stream.
  const uint32_t* block(int64_t b) const { return w + b * k2 * kBlockCols; }
  int64_t ldy() const { return silu != nullptr ? n / 2 : n; }
};

// fp32: packed [N / 16][K][16], block b, k the 64-byte line W[16b + c][k] for c in 0..15.
struct ProblemF32 {
  const float* x;     // [M, K], row stride ldx
  int64_t ldx;
  const float* w;     // packed
  int64_t k;          // K
  const float* bias;  // [N], or nullptr
  float* y;           // [M, N], row-major
  int64_t n;          // N
  int64_t m;          // M
  const float* block(int64_t b) const { return w + b * k * kBlockCols; }
};

#if defined(__AVX512BF16__)
// bf16(acc + bias[col ..]), rounded to nearest even: an output's bits.
inline __m256i round16(const Problem& pb, __m512 acc, int64_t col) {
  if (pb.bias != nullptr) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb.bias + col));
    acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
  }
  return (__m256i)_mm512_cvtneps_pbh(acc);
}

// y[row, col .. col + 15] = bf16(acc + bias[col ..]), rounded to nearest even.
inline void store16(const Problem& pb, __m512 acc, int64_t row, int64_t col) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb.y + row * pb.n + col), round16(pb, acc, col));
}
#endif

// Each solves the whole problem, threads splitting the blocks; only called when the build
// has it and the CPU runs it (cpu_has).
void gemm_avx2(const Problem& pb);
void gemm_avx512bf16(const Problem& pb);
void gemm_amx(const Problem& pb);  // also gated (pb.silu), where N / 2 is whole blocks
void gemm_f32_avx2(const ProblemF32& pb);
void gemm_f32_avx512(const ProblemF32& pb);

}  // namespace pdserve::gemm
