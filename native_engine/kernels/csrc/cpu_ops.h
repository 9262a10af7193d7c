// The ops of this extension that other translation units call directly (decode_layer.cpp,
// fused_ops.cpp): each dispatching op is also registered as torch.ops.pdserve_cpu.<name> where
// it is defined.
#pragma once

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>

#include <tuple>
#include <utility>

namespace pdserve {
// A new CPU tensor, and a view of one, made without a trip through torch's dispatcher: in a
// decode step the first dispatcher call after a GEMM finds the dispatcher's code and tables
// evicted by the weight stream (5-10 us each at batch 1 on a 2-core AMX box, where a layer's
// work is ~380 us), and a layer made ~10 such calls.
inline at::Tensor empty_cpu(at::IntArrayRef sizes, const at::Tensor& like) {
  return at::detail::empty_cpu(sizes, like.scalar_type(), false, c10::nullopt);
}
inline at::Tensor empty_cpu(at::IntArrayRef sizes, at::ScalarType dtype) {
  return at::detail::empty_cpu(sizes, dtype, false, c10::nullopt);
}
// base's elements from `offset` (in elements, past base's own) with these sizes and strides:
// what base.as_strided would give, sharing base's storage (so it keeps it alive), but
// unchecked against the storage's size, without a version counter shared with base and
// without autograd's view record. For views inside a kernel only, read through their
// pointers; never returned to Python.
inline at::Tensor view_of(const at::Tensor& base, at::IntArrayRef sizes, at::IntArrayRef strides,
                          int64_t offset) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW,
                                                   c10::Storage(base.storage()),
                                                   base.key_set(), base.dtype());
  impl->set_sizes_and_strides(sizes, strides, base.storage_offset() + offset);
  return at::Tensor(std::move(impl));
}
}  // namespace pdserve

// bf16 or fp32, by the tensors' dtype.
at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& packed,
                      const c10::optional<at::Tensor>& bias, int64_t k, int64_t isa);
// silu_mul(small_gemm(...)), bit for bit (fused on AMX).
at::Tensor small_gemm_silu_mul(const at::Tensor& x, const at::Tensor& packed,
                               const c10::optional<at::Tensor>& bias, int64_t k, int64_t isa);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& residual,
                                                const at::Tensor& delta,
                                                const at::Tensor& weight, double eps);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin);
at::Tensor silu_mul(const at::Tensor& gate_up);

namespace pdserve {
// paged_decode_attention (paged_decode_attention_cpu.cpp), for a cache of the query's dtype.
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale);
}  // namespace pdserve

namespace pdserve::f32 {
// The fp32 forms (fused_ops_f32.cpp), which the ops above call for fp32 tensors once they have
// checked the shapes and dtypes.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& residual,
                                                const at::Tensor& delta,
                                                const at::Tensor& weight, double eps);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin);
at::Tensor silu_mul(const at::Tensor& gate_up);
}  // namespace pdserve::f32
