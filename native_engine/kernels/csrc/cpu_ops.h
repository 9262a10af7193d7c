// The ops of this extension that other translation units call directly (decode_layer.cpp):
// each is also registered as torch.ops.pdserve_cpu.<name> where it is defined.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

at::Tensor small_gemm_bf16(const at::Tensor& x, const at::Tensor& packed,
                           const c10::optional<at::Tensor>& bias, int64_t k, int64_t isa);
at::Tensor rms_norm_bf16(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm_bf16(const at::Tensor& residual,
                                                     const at::Tensor& delta,
                                                     const at::Tensor& weight, double eps);
at::Tensor rotary_bf16(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& ssin);
at::Tensor silu_mul_bf16(const at::Tensor& gate_up);

namespace pdserve {
// paged_decode_attention (paged_decode_attention_cpu.cpp), for a cache of the query's dtype.
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale);
}  // namespace pdserve
