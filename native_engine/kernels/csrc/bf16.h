// bf16 <-> fp32 as torch converts them: bf16 is fp32's top half (widening is exact), and
// narrowing rounds to nearest, ties to even (a NaN stays a quiet NaN).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pdserve {

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

#if defined(__AVX512F__)
// 16 at a time, as the scalar forms above (vcvtneps2bf16 alone flushes denormals, torch does
// not).
inline __m512 bf16x16_to_float(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline __m256i float_to_bf16x16(__m512 v) {
#if defined(__AVX512BF16__)
  // vcvtneps2bf16 is these bits (nearest even, a NaN quieted as above) for every input but a
  // denormal, which it flushes to zero: one instruction, and a class test sends the rare
  // vector holding a denormal the long way (the rounding is a third of a bf16 op's work).
  if (_mm512_fpclass_ps_mask(v, 0x20) == 0) return (__m256i)_mm512_cvtneps_pbh(v);
#endif
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f800000));
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
}

inline void store_bf16x16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), float_to_bf16x16(v));
}

inline __m512 round_bf16x16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(float_to_bf16x16(v)), 16));
}
#endif

}  // namespace pdserve
