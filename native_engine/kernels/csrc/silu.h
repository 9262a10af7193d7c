// torch's SiLU, bit for bit, in the forms the kernels use: on 16 fp32 lanes (fused_ops_f32.cpp
// keeps it in fp32), and in bf16 as a table of its rounded bits with the product by up
// (fused_ops.cpp's silu_mul, and the AMX GEMM's SiLU x up epilogue, small_gemm_amx.cpp).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>
#include <sleef.h>

#include <cstdint>
#include <vector>

#include "bf16.h"

namespace pdserve {

// x / (1 + exp(-x)) with SLEEF's expf (the exp torch vectorizes with, which libtorch exports).
inline __m512 silu16(__m512 g) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i sign = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  const __m512 e = Sleef_expf16_u10(  // exp(-g), as torch's neg()
      _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), sign)));
  // The rounding-mode forms: -ffast-math would make a plain division a reciprocal estimate
  // (not torch's bits; NaN where exp(-x) overflows).
  return _mm512_div_round_ps(g, _mm512_add_round_ps(_mm512_set1_ps(1.0f), e, kRound), kRound);
}

// bf16(silu(g)) for every bf16 g, by its bits, computed once per process (a gate is one of
// 65536 values: a look-up is its SiLU's bits, at half the time of computing them: SLEEF's exp
// is ~20 vector instructions, and this CPU's vector units are slow). Padded: a gather reads 4
// bytes.
inline const uint16_t* silu_table() {
  static const std::vector<uint16_t> table = [] {
    std::vector<uint16_t> t((1 << 16) + 16);
    for (uint32_t i = 0; i < (1u << 16); i += 16) {
      const __m512i bits = _mm512_add_epi32(
          _mm512_set1_epi32(static_cast<int32_t>(i)),
          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
      const __m512 g = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.data() + i),
                          float_to_bf16x16(silu16(g)));
    }
    return t;
  }();
  return table.data();
}

// bf16(bf16(silu(gate)) * up) of 16 bf16 gates and ups (bits), as HF rounds op by op: the
// SiLU's bits from `table` (silu_table()), the product in fp32, rounded once.
inline __m256i silu_mul_bf16x16(__m256i gate, __m256i up, const uint16_t* table) {
  const __m512i bits = _mm512_cvtepu16_epi32(gate);
  const __m512 u = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(up), 16));
  // 4 bytes at entry `bits` (its low half): the padding keeps the last one in bounds.
  const __m512i got = _mm512_i32gather_epi32(bits, reinterpret_cast<const int*>(table), 2);
  const __m512 act = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_and_si512(got, _mm512_set1_epi32(0xffff)), 16));
  return float_to_bf16x16(_mm512_mul_ps(act, u));
}

}  // namespace pdserve
#endif
