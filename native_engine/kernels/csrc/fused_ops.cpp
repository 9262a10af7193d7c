// The decode step's work outside the GEMMs, one pass each: RMSNorm (with the residual add
// before it), rotary embedding, SiLU(gate) x up. Each op takes bf16 (the kernels here) or fp32
// tensors (fused_ops_f32.cpp); its shapes and dtypes are checked here, once for both.
//
// In bf16 each rounds as HF transformers does op by op in bf16 (the engine's contract is HF's
// tokens): an elementwise op computes in fp32 and rounds to bf16 where torch would, so
// rotary and SiLU x up are HF's bit for bit. RMSNorm's mean of squares is one fp32 sum, in
// the order the compiler vectorizes it (on the CPUs measured, torch's); where the order
// differs a result moves by one bf16 rounding (tests/engine/test_fused_ops.py bounds it).
//
// Unfused, a layer's norms, rotary and activation are ~25 torch ops of 1-4 us each at decode
// sizes, a third of a batch-1 step on the real model.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "bf16.h"
#include "cpu_ops.h"
#include "rotary_rows.h"
#include "silu.h"

namespace {

using pdserve::bf16_to_float;
using pdserve::float_to_bf16;
using pdserve::round_bf16;
#if defined(__AVX512F__)
using pdserve::bf16x16_to_float;
using pdserve::float_to_bf16x16;
using pdserve::round_bf16x16;
using pdserve::store_bf16x16;
#endif

const uint16_t* in(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

uint16_t* out(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

// The dtype of an op's first tensor: bf16 or fp32.
at::ScalarType op_dtype(const at::Tensor& t, const char* op) {
  const at::ScalarType dtype = t.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, op, ": bf16 or fp32 tensors, got ",
              dtype);
  return dtype;
}

void check_rows(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == dtype && t.stride(1) == 1, name,
              " must be [rows, size] ", dtype, " with unit column stride");
}

void check_weight(const at::Tensor& w, at::ScalarType dtype, int64_t size, const char* name) {
  TORCH_CHECK(w.scalar_type() == dtype && w.numel() == size && w.is_contiguous(), name,
              ": weight must be [size] ", dtype);
}

// HF's LlamaRMSNorm on one row: weight * bf16(x32 * rsqrt(mean(x32^2) + eps)).
void norm_row(const uint16_t* x, const uint16_t* w, int64_t size, float eps, uint16_t* y) {
  float sum = 0.0f;
  for (int64_t i = 0; i < size; ++i) {
    const float v = bf16_to_float(x[i]);
    sum += v * v;
  }
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(size) + eps);
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 inv_v = _mm512_set1_ps(inv);
  for (; i + 16 <= size; i += 16) {
    const __m512 normed = round_bf16x16(_mm512_mul_ps(bf16x16_to_float(x + i), inv_v));
    store_bf16x16(y + i, _mm512_mul_ps(bf16x16_to_float(w + i), normed));
  }
#endif
  for (; i < size; ++i)
    y[i] = float_to_bf16(bf16_to_float(w[i]) * round_bf16(bf16_to_float(x[i]) * inv));
}

// a + b rounded to bf16, n elements.
void add_row(const uint16_t* a, const uint16_t* b, int64_t n, uint16_t* sum) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    store_bf16x16(sum + i, _mm512_add_ps(bf16x16_to_float(a + i), bf16x16_to_float(b + i)));
#endif
  for (; i < n; ++i) sum[i] = float_to_bf16(bf16_to_float(a[i]) + bf16_to_float(b[i]));
}

at::Tensor rms_norm_bf16(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), size = x.size(1);
  at::Tensor y = pdserve::empty_cpu({rows, size}, x);
  const uint16_t *px = in(x), *pw = in(weight);
  uint16_t* py = out(y);
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      norm_row(px + r * ldx, pw, size, static_cast<float>(eps), py + r * size);
  });
  return y;
}

// residual + delta (rounded to bf16, as HF's ``x = x + attn(...)``), then its RMSNorm: the
// sum (the next residual) and the normed rows, in one pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm_bf16(const at::Tensor& residual,
                                                     const at::Tensor& delta,
                                                     const at::Tensor& weight, double eps) {
  const int64_t rows = residual.size(0), size = residual.size(1);
  at::Tensor sum = pdserve::empty_cpu({rows, size}, residual);
  at::Tensor y = pdserve::empty_cpu({rows, size}, residual);
  const uint16_t *pr = in(residual), *pd = in(delta), *pw = in(weight);
  uint16_t *ps = out(sum), *py = out(y);
  const int64_t ldr = residual.stride(0), ldd = delta.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      uint16_t* s = ps + r * size;
      add_row(pr + r * ldr, pd + r * ldd, size, s);
      norm_row(s, pw, size, static_cast<float>(eps), py + r * size);
    }
  });
  return {sum, y};
}

// HF's x * cos + rotate_half(x) * sin, each product and the sum rounded to bf16; ``signed_sin``
// is sin with its first half negated (RotaryEmbedding's table), so rotate_half is a roll.
at::Tensor rotary_bf16(const at::Tensor& x,      // [tokens, heads, head_dim]
                       const at::Tensor& cos,    // [tokens, 1, head_dim]
                       const at::Tensor& ssin) {  // [tokens, 1, head_dim]
  const int64_t dim = x.size(2), half = dim / 2;
  const auto body = [&](const uint16_t* row, const uint16_t* c, const uint16_t* s, uint16_t* o) {
    int64_t i = 0;
#if defined(__AVX512F__)
    if (half % 16 == 0) {  // the rolled row is whole vectors of the row
      for (; i < dim; i += 16) {
        const __m512 a =
            round_bf16x16(_mm512_mul_ps(bf16x16_to_float(row + i), bf16x16_to_float(c + i)));
        const __m512 b = round_bf16x16(_mm512_mul_ps(
            bf16x16_to_float(row + (i < half ? i + half : i - half)), bf16x16_to_float(s + i)));
        store_bf16x16(o + i, _mm512_add_ps(a, b));
      }
    }
#endif
    for (; i < dim; ++i) {
      const float rolled = bf16_to_float(row[i < half ? i + half : i - half]);
      o[i] = float_to_bf16(round_bf16(bf16_to_float(row[i]) * bf16_to_float(c[i])) +
                           round_bf16(rolled * bf16_to_float(s[i])));
    }
  };
  return pdserve::for_each_rotary_row<uint16_t>(x, cos, ssin, body);
}


// bf16(silu(gate)) * up, rounded: gate_up is [rows, 2 * size] (gate | up, as fused at load).
// SiLU is torch's arithmetic, x / (1 + exp(-x)) in fp32 with torch's own vectorized exp
// (SLEEF's expf, 1-ulp, which libtorch exports), so its bits are at::silu's for every bf16
// input (tests/engine/test_fused_ops.py checks all 65536); a correctly rounded scalar exp is
// ~20x slower and a faster one is not torch's bits. With AVX-512 each gate's SiLU is looked up
// in silu_table (0.64-0.80 ms against 1.4-2.0 ms computed, 2048 x 1536 on 2 threads). One
// pass: at::silu and then the product were two over the [rows, size] tensor.
at::Tensor silu_mul_bf16(const at::Tensor& gate_up) {
  const int64_t rows = gate_up.size(0), size = gate_up.size(1) / 2;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  at::Tensor y = pdserve::empty_cpu({rows, size}, gate_up);
  const uint16_t* pg = in(gate_up);
  uint16_t* py = out(y);
  const int64_t ld = gate_up.stride(0);
  const uint16_t* table = pdserve::silu_table();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t *gate = pg + r * ld, *up = gate + size;
      uint16_t* row = py + r * size;
      for (int64_t i = 0; i < size; i += 16) {
        const int64_t n = std::min<int64_t>(16, size - i);
        const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1u);
        _mm256_mask_storeu_epi16(row + i, mask,
                                 pdserve::silu_mul_bf16x16(_mm256_maskz_loadu_epi16(mask, gate + i),
                                                           _mm256_maskz_loadu_epi16(mask, up + i),
                                                           table));
      }
    }
  });
  return y;
#else
  at::Tensor y = at::silu(gate_up.narrow(1, 0, size));  // contiguous [rows, size]
  const uint16_t* pu = in(gate_up) + size;
  uint16_t* py = out(y);
  const int64_t ld = gate_up.stride(0);
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      uint16_t* row = py + r * size;
      const uint16_t* up = pu + r * ld;
      for (int64_t i = 0; i < size; ++i)
        row[i] = float_to_bf16(bf16_to_float(row[i]) * bf16_to_float(up[i]));
    }
  });
  return y;
#endif
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::ScalarType dtype = op_dtype(x, "rms_norm");
  check_rows(x, dtype, "rms_norm: x");
  check_weight(weight, dtype, x.size(1), "rms_norm");
  return dtype == at::kFloat ? pdserve::f32::rms_norm(x, weight, eps)
                             : rms_norm_bf16(x, weight, eps);
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& residual,
                                                const at::Tensor& delta,
                                                const at::Tensor& weight, double eps) {
  const at::ScalarType dtype = op_dtype(residual, "add_rms_norm");
  check_rows(residual, dtype, "add_rms_norm: residual");
  check_rows(delta, dtype, "add_rms_norm: delta");
  TORCH_CHECK(residual.sizes() == delta.sizes(), "add_rms_norm: shapes differ");
  check_weight(weight, dtype, residual.size(1), "add_rms_norm");
  return dtype == at::kFloat ? pdserve::f32::add_rms_norm(residual, delta, weight, eps)
                             : add_rms_norm_bf16(residual, delta, weight, eps);
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  const at::ScalarType dtype = op_dtype(x, "rotary");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rotary: x must be [tokens, heads, head_dim], rows contiguous");
  TORCH_CHECK(x.size(2) % 2 == 0, "rotary: head_dim must be even");
  for (const at::Tensor* t : {&cos, &signed_sin}) {
    TORCH_CHECK(t->scalar_type() == dtype && t->dim() == 3 && t->size(0) == x.size(0) &&
                    t->size(2) == x.size(2) && t->stride(2) == 1,
                "rotary: cos and sin must be [tokens, 1, head_dim] in x's dtype");
  }
  return dtype == at::kFloat ? pdserve::f32::rotary(x, cos, signed_sin)
                             : rotary_bf16(x, cos, signed_sin);
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  const at::ScalarType dtype = op_dtype(gate_up, "silu_mul");
  check_rows(gate_up, dtype, "silu_mul: gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: gate_up must have an even width");
  return dtype == at::kFloat ? pdserve::f32::silu_mul(gate_up) : silu_mul_bf16(gate_up);
}

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor residual, Tensor delta, Tensor weight, float eps) -> "
        "(Tensor, Tensor)");
  m.def("rotary(Tensor x, Tensor cos, Tensor signed_sin) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("rotary", rotary);
  m.impl("silu_mul", silu_mul);
}
