// torch's SiLU on 16 fp32 lanes, bit for bit: x / (1 + exp(-x)) with SLEEF's expf (the exp
// torch vectorizes with, which libtorch exports). fused_ops.cpp rounds it to bf16 (its SiLU
// table), fused_ops_f32.cpp keeps it.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>
#include <sleef.h>

namespace pdserve {

inline __m512 silu16(__m512 g) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i sign = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  const __m512 e = Sleef_expf16_u10(  // exp(-g), as torch's neg()
      _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), sign)));
  // The rounding-mode forms: -ffast-math would make a plain division a reciprocal estimate
  // (not torch's bits; NaN where exp(-x) overflows).
  return _mm512_div_round_ps(g, _mm512_add_round_ps(_mm512_set1_ps(1.0f), e, kRound), kRound);
}

}  // namespace pdserve
#endif
