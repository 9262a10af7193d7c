// The fp32 step's work outside the GEMMs (fused_ops.cpp checks the shapes, then calls these):
// rotary and SiLU(gate) x up one pass each; RMSNorm with the residual add before it.
//
// Each op rounds where torch's fp32 ops do, one rounding per torch op: the vector forms use
// the explicit-rounding intrinsics, which the compiler never contracts into an FMA (the build
// is -ffast-math, under which a plain a * b + c * d may become one). So rotary and SiLU x up
// are torch's bits (tests/engine/test_fused_ops.py); RMSNorm's sum of squares is torch's own
// reduction, so its result is too. Without AVX-512F each op is torch's own ops.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <tuple>

#include "cpu_ops.h"
#include "rotary_rows.h"
#include "silu.h"

namespace pdserve::f32 {
namespace {

#if defined(__AVX512F__)
constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

inline __m512 mul(__m512 a, __m512 b) { return _mm512_mul_round_ps(a, b, kRound); }
inline __m512 add(__m512 a, __m512 b) { return _mm512_add_round_ps(a, b, kRound); }
inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? 0xffff : static_cast<__mmask16>((1u << n) - 1u);
}
#endif

}  // namespace

#if defined(__AVX512F__)
namespace {

// RMSNorm's second half, given the squares of x [rows, size] (row stride ldx): each row's
// sum of squares is torch's own at::sum (its cascade order: HF's bits, which a sum in another
// order is not; tests/engine/test_layers_exact.py), then mean, + eps, 1 / sqrt and the two
// products, each rounded as torch's op.
at::Tensor normed(const float* px, int64_t ldx, const at::Tensor& squares,
                  const at::Tensor& weight, double eps) {
  const int64_t rows = squares.size(0), size = squares.size(1);
  const at::Tensor sums = at::sum(squares, {1});  // [rows]
  const float* ps = sums.data_ptr<float>();
  const float* pw = weight.data_ptr<float>();
  at::Tensor y = pdserve::empty_cpu({rows, size}, squares);
  float* py = y.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      // mean = sum / size, + eps, rsqrt as 1 / sqrt: torch's div_, add and rsqrt.
      const __m128 mean = _mm_div_round_ss(_mm_set_ss(ps[r]),
                                           _mm_set_ss(static_cast<float>(size)), kRound);
      const __m128 var = _mm_add_round_ss(mean, _mm_set_ss(static_cast<float>(eps)), kRound);
      const __m128 inv = _mm_div_round_ss(_mm_set_ss(1.0f), _mm_sqrt_round_ss(var, var, kRound),
                                          kRound);
      const __m512 scale = _mm512_broadcastss_ps(inv);
      for (int64_t i = 0; i < size; i += 16) {
        const __mmask16 m = lanes(size - i);
        const __m512 normed = mul(_mm512_maskz_loadu_ps(m, px + r * ldx + i), scale);
        _mm512_mask_storeu_ps(py + r * size + i, m, mul(_mm512_maskz_loadu_ps(m, pw + i), normed));
      }
    }
  });
  return y;
}

}  // namespace
#endif

// HF's LlamaRMSNorm in fp32, weight * (x * rsqrt(mean(x^2) + eps)): the squares one pass
// here, then `normed`. at::rms_norm gives the same bits as ~10 ATen ops, 60 us a call at
// decode sizes (4 ms of a SmolLM2 step); this is two.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
#if defined(__AVX512F__)
  const int64_t rows = x.size(0), size = x.size(1), ldx = x.stride(0);
  const float* px = x.data_ptr<float>();
  at::Tensor squares = pdserve::empty_cpu({rows, size}, x);
  float* pq = squares.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t i = 0; i < size; i += 16) {
        const __mmask16 m = lanes(size - i);
        const __m512 v = _mm512_maskz_loadu_ps(m, px + r * ldx + i);
        _mm512_mask_storeu_ps(pq + r * size + i, m, mul(v, v));
      }
  });
  return normed(px, ldx, squares, weight, eps);
#else
  return at::rms_norm(x, {x.size(1)}, weight, eps);
#endif
}

// residual + delta (one rounded add, torch's bits) and its RMSNorm: the add and the squares
// in one pass (at::add was ~20 us a call at decode sizes).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& residual,
                                                const at::Tensor& delta,
                                                const at::Tensor& weight, double eps) {
#if defined(__AVX512F__)
  const int64_t rows = residual.size(0), size = residual.size(1);
  const int64_t ldr = residual.stride(0), ldd = delta.stride(0);
  const float *pr = residual.data_ptr<float>(), *pd = delta.data_ptr<float>();
  at::Tensor sum = pdserve::empty_cpu({rows, size}, residual);
  at::Tensor squares = pdserve::empty_cpu({rows, size}, residual);
  float *ps = sum.data_ptr<float>(), *pq = squares.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t i = 0; i < size; i += 16) {
        const __mmask16 m = lanes(size - i);
        const __m512 v = add(_mm512_maskz_loadu_ps(m, pr + r * ldr + i),
                             _mm512_maskz_loadu_ps(m, pd + r * ldd + i));
        _mm512_mask_storeu_ps(ps + r * size + i, m, v);
        _mm512_mask_storeu_ps(pq + r * size + i, m, mul(v, v));
      }
  });
  return {sum, normed(ps, size, squares, weight, eps)};
#else
  at::Tensor sum = residual + delta;
  return {sum, rms_norm(sum, weight, eps)};
#endif
}

// x * cos + roll(x, half) * signed_sin: two products and a sum, each rounded (torch's three ops).
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& ssin) {
  const int64_t half = x.size(2) / 2;
#if defined(__AVX512F__)
  // Each half against the other: lanes [i, i + 16) of a half stay within it.
  const auto body = [&](const float* row, const float* c, const float* s, float* o) {
    for (int64_t i = 0; i < half; i += 16) {
      const __mmask16 m = lanes(half - i);
      const __m512 lo = _mm512_maskz_loadu_ps(m, row + i);
      const __m512 hi = _mm512_maskz_loadu_ps(m, row + half + i);
      _mm512_mask_storeu_ps(o + i, m,
                            add(mul(lo, _mm512_maskz_loadu_ps(m, c + i)),
                                mul(hi, _mm512_maskz_loadu_ps(m, s + i))));
      _mm512_mask_storeu_ps(o + half + i, m,
                            add(mul(hi, _mm512_maskz_loadu_ps(m, c + half + i)),
                                mul(lo, _mm512_maskz_loadu_ps(m, s + half + i))));
    }
  };
  return pdserve::for_each_rotary_row<float>(x, cos, ssin, body);
#else
  return x * cos + x.roll(half, -1) * ssin;
#endif
}

// silu(gate) * up, gate_up [rows, 2 * size]: torch's silu (silu.h), then the product.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  const int64_t rows = gate_up.size(0), size = gate_up.size(1) / 2;
#if defined(__AVX512F__)
  at::Tensor y = pdserve::empty_cpu({rows, size}, gate_up);
  const float* pg = gate_up.data_ptr<float>();
  float* py = y.data_ptr<float>();
  const int64_t ld = gate_up.stride(0);
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float *gate = pg + r * ld, *up = gate + size;
      for (int64_t i = 0; i < size; i += 16) {
        const __mmask16 m = lanes(size - i);
        const __m512 act = pdserve::silu16(_mm512_maskz_loadu_ps(m, gate + i));
        _mm512_mask_storeu_ps(py + r * size + i, m, mul(act, _mm512_maskz_loadu_ps(m, up + i)));
      }
    }
  });
  return y;
#else
  return at::silu(gate_up.narrow(1, 0, size)) * gate_up.narrow(1, size, size);
#endif
}

}  // namespace pdserve::f32
