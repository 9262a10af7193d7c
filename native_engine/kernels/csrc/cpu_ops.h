// The ops of this extension that other translation units call directly (decode_layer.cpp,
// fused_ops.cpp): each dispatching op is also registered as torch.ops.pdserve_cpu.<name> where
// it is defined.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

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
