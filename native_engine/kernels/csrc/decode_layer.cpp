// The decoder layers of a bf16 or fp32 decode step, in one call: the same kernels the Python
// layer calls (so the same bits: tests/engine/test_decode_layer.py), without the ~40
// interpreter round trips a layer would cost between them (at batch 1, about a layer's
// attention), nor one a layer into this op: ~50 us each at batch 1 on a 2-core AMX box, where
// a layer's own work is ~380 us (the op's 21 arguments, and a Python path a weight stream has
// just evicted from the caches).
//
// Llama-family layers (native_engine/models/llama.py) whose GEMMs all run on the small-M
// kernel, a full-precision paged cache of the model's dtype and the CPU attention kernel; the
// caller checks that (LlamaFamilyForCausalLM._fused_decode) and takes the Python path
// otherwise.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>
#include <tuple>

#include "cpu_ops.h"

namespace {

// This step's new keys and values into the cache, at their slots (block * block_size + offset).
void store_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
              const at::Tensor& v_cache, const at::Tensor& slots) {
  const int64_t tokens = k.size(0), row = k.size(1) * k.size(2);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  const int64_t size = k.element_size(), bytes = row * size;
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "decode_layer: slot ", slot[t],
                " out of range");
    std::memcpy(kc + slot[t] * bytes, kp + t * k.stride(0) * size, bytes);
    std::memcpy(vc + slot[t] * bytes, vp + t * v.stride(0) * size, bytes);
  }
}

// One layer: its output, and the residual stream before it.
std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& x,                         // [T, hidden]: the last layer's output
    const c10::optional<at::Tensor>& residual,   // the stream before it; none at layer 0
    const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
    const at::Tensor& qkv, const c10::optional<at::Tensor>& qkv_bias, const at::Tensor& o,
    const at::Tensor& gate_up, const at::Tensor& down,  // packed by pack_weight
    const at::Tensor& cos, const at::Tensor& signed_sin,  // [T, 1, head_dim]
    const at::Tensor& k_cache, const at::Tensor& v_cache,  // [blocks, block_size, kv_heads, D]
    const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& context_lens,
    int64_t num_q_heads, int64_t num_kv_heads, double scale, int64_t isa) {
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kBFloat16 || dtype == at::kFloat),
              "decode_layer: x must be [tokens, hidden] bf16 or fp32");
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == num_kv_heads,
              "decode_layer: caches [blocks, block_size, kv_heads, head_dim] in x's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == x.size(0) &&
                  slots.is_contiguous(),
              "decode_layer: one int64 slot per token");
  const int64_t tokens = x.size(0), hidden = x.size(1), head_dim = k_cache.size(3);
  const int64_t q_size = num_q_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor stream, h;
  if (residual.has_value()) {
    std::tie(stream, h) = add_rms_norm(*residual, x, input_norm, eps);
  } else {
    stream = x;
    h = rms_norm(x, input_norm, eps);
  }
  const at::Tensor proj = small_gemm(h, qkv, qkv_bias, hidden, isa);  // [T, q + 2 kv]
  // Views by pdserve::view_of (cpu_ops.h), not narrow / view: no dispatcher calls.
  const int64_t ld = proj.stride(0), heads = num_q_heads + num_kv_heads;
  const at::Tensor qk = pdserve::view_of(proj, {tokens, heads, head_dim}, {ld, head_dim, 1}, 0);
  const at::Tensor rotated = rotary(qk, cos, signed_sin);  // [T, q + kv heads, D]
  TORCH_CHECK(rotated.is_contiguous(), "decode_layer: rotary's output must be contiguous");
  const int64_t rd = heads * head_dim;
  const at::Tensor q =
      pdserve::view_of(rotated, {tokens, num_q_heads, head_dim}, {rd, head_dim, 1}, 0);
  const at::Tensor k =
      pdserve::view_of(rotated, {tokens, num_kv_heads, head_dim}, {rd, head_dim, 1}, q_size);
  const at::Tensor v = pdserve::view_of(proj, {tokens, num_kv_heads, head_dim}, {ld, head_dim, 1},
                                        q_size + kv_size);
  store_kv(k, v, k_cache, v_cache, slots);
  const at::Tensor attn =
      pdserve::decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale);
  TORCH_CHECK(attn.is_contiguous(), "decode_layer: attention's output must be contiguous");
  const at::Tensor attn_rows = pdserve::view_of(attn, {tokens, q_size}, {q_size, 1}, 0);
  const at::Tensor out = small_gemm(attn_rows, o, c10::nullopt, q_size, isa);
  std::tie(stream, h) = add_rms_norm(stream, out, post_norm, eps);
  const at::Tensor act = small_gemm_silu_mul(h, gate_up, c10::nullopt, hidden, isa);
  const at::Tensor mlp = small_gemm(act, down, c10::nullopt, act.size(1), isa);
  return {mlp, stream};
}

}  // namespace

// Every layer in turn, layer i's weights at index i of each list (qkv_bias empty where the
// model has none); the caches are written at ``slots``. Returns the last layer's output and
// the residual stream before it.
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual, at::TensorList input_norms,
    at::TensorList post_norms, double eps, at::TensorList qkv, at::TensorList qkv_bias,
    at::TensorList o, at::TensorList gate_up, at::TensorList down, const at::Tensor& cos,
    const at::Tensor& signed_sin, at::TensorList k_caches, at::TensorList v_caches,
    const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& context_lens,
    int64_t num_q_heads, int64_t num_kv_heads, double scale, int64_t isa) {
  const size_t layers = input_norms.size();
  TORCH_CHECK(post_norms.size() == layers && qkv.size() == layers && o.size() == layers &&
                  gate_up.size() == layers && down.size() == layers &&
                  k_caches.size() == layers && v_caches.size() == layers &&
                  (qkv_bias.empty() || qkv_bias.size() == layers),
              "decode_layers: one of each weight and cache a layer (qkv_bias: or none)");
  TORCH_CHECK(layers > 0, "decode_layers: no layers");
  const at::Tensor slot_ids = slots.contiguous();
  at::Tensor out = x;
  c10::optional<at::Tensor> stream = residual;
  for (size_t i = 0; i < layers; ++i) {
    const c10::optional<at::Tensor> bias =
        qkv_bias.empty() ? c10::nullopt : c10::optional<at::Tensor>(qkv_bias[i]);
    auto [next, before] = decode_layer(out, stream, input_norms[i], post_norms[i], eps, qkv[i],
                                       bias, o[i], gate_up[i], down[i], cos, signed_sin,
                                       k_caches[i], v_caches[i], slot_ids, block_tables,
                                       context_lens, num_q_heads, num_kv_heads, scale, isa);
    out = std::move(next);
    stream = std::move(before);
  }
  return {out, *stream};
}

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def(
      "decode_layers(Tensor x, Tensor? residual, Tensor[] input_norms, Tensor[] post_norms, "
      "float eps, Tensor[] qkv, Tensor[] qkv_bias, Tensor[] o, Tensor[] gate_up, "
      "Tensor[] down, Tensor cos, Tensor signed_sin, Tensor(a!)[] k_caches, "
      "Tensor(b!)[] v_caches, Tensor slots, Tensor block_tables, Tensor context_lens, "
      "int num_q_heads, int num_kv_heads, float scale, int isa) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("decode_layers", decode_layers); }
