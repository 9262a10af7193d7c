// exp for softmaxes, 16 lanes at a time: decode attention (decode_span.cpp) and prefill
// attention (prefill_attention_amx.cpp) weigh scores with it.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pdserve {

#if defined(__AVX512F__)
// exp(x) for x <= 0 (a score minus its row's max), 16 at a time: x = n ln2 + r with |r| <=
// ln2 / 2, exp(r) by its Taylor series to r^7 (relative error < 1e-8, under fp32's rounding),
// times 2^n built in the exponent bits. Below -87.3 (exp < 2^-126) it gives 2^-126 x exp(r):
// a weight of ~1e-38 next to the max's 1. The scalar exp, one call per score, was most of a
// decode step's attention at batch 32.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2, ln2 in two parts so that n ln2 is exact enough.
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i scale = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(scale));
}
#endif

}  // namespace pdserve
