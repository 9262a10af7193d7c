// exp for softmaxes, 16 lanes at a time: decode attention (decode_span.h, decode_span_amx.cpp)
// and prefill attention (prefill_attention_amx.cpp) weigh scores with it.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pdserve {

#if defined(__AVX512F__)
// 2^x for x <= 0, 16 at a time: x = n + f with |f| <= 1/2 (f exact), 2^f = exp(f ln2) by its
// Taylor series to the 6th power (relative error < 2e-7, about fp32's rounding), scaled by 2^n
// (vscalefps). Below -126 it gives 2^-126 (the clamp): a weight of ~1e-38 next to the max's 1;
// a small positive x (a max's own rounding) is fine. Ten vector instructions: on this CPU's
// scarce vector throughput the exp is most of a softmax, prefill attention's above all.
inline __m512 exp2_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530e-4f);                  // ln2^6 / 720
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));  // ln2^5 / 120
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));  // ln2^4 / 24
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));  // ln2^3 / 6
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));  // ln2^2 / 2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));  // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

constexpr float kLog2e = 1.44269504f;

// exp(x) for x <= 0 (a score minus its row's max): 2^(x log2 e). The product's rounding moves
// the result by up to |x| 2^-24 relatively (6e-7 at x = -10, a weight of 5e-5).
inline __m512 exp_nonpositive(__m512 x) {
  return exp2_nonpositive(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)));
}
#endif

}  // namespace pdserve
