// bf16 <-> fp32 as torch converts them: bf16 is fp32's top half (widening is exact), and
// narrowing rounds to nearest, ties to even (a NaN stays a quiet NaN).
#pragma once

#include <cstdint>
#include <cstring>

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

}  // namespace pdserve
