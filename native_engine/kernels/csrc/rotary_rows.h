// The loop both rotary kernels share (fused_ops.cpp: bf16, fused_ops_f32.cpp: fp32): each
// (token, head) row of x [tokens, heads, head_dim] (rows of unit stride), tokens split over
// threads, handed to the dtype's body with its token's cos and signed-sin rows and its row of
// the output.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>

#include "cpu_ops.h"

namespace pdserve {

// body(const T* row, const T* cos, const T* signed_sin, T* out); T is the element's storage
// type (uint16_t for bf16, float for fp32).
template <typename T, typename Body>
at::Tensor for_each_rotary_row(const at::Tensor& x, const at::Tensor& cos,
                               const at::Tensor& signed_sin, Body body) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  at::Tensor y = pdserve::empty_cpu({tokens, heads, dim}, x);
  const T* px = static_cast<const T*>(x.data_ptr());
  const T* pc = static_cast<const T*>(cos.data_ptr());
  const T* ps = static_cast<const T*>(signed_sin.data_ptr());
  T* py = static_cast<T*>(y.data_ptr());
  const int64_t ldx = x.stride(0), ldc = cos.stride(0), lds = signed_sin.stride(0);
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h)
        body(px + t * ldx + h * dim, pc + t * ldc, ps + t * lds, py + (t * heads + h) * dim);
  });
  return y;
}

}  // namespace pdserve
