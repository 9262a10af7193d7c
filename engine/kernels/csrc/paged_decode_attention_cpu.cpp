// Paged decode attention for CPU, fp32: reads each sequence's K/V blocks in place, once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

at::Tensor paged_decode_attention(
    const at::Tensor& query,         // [num_seqs, num_q_heads, head_dim]
    const at::Tensor& k_cache,       // [num_blocks, block_size, num_kv_heads, head_dim]
    const at::Tensor& v_cache,       // same
    const at::Tensor& block_tables,  // [num_seqs, max_blocks] int32
    const at::Tensor& context_lens,  // [num_seqs] int32
    double scale) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
              v_cache.scalar_type() == at::kFloat, "paged_decode_attention: float32 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
              query.size(2) == k_cache.size(3), "query [S, Hq, D] / cache [N, B, Hkv, D] mismatch");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "num_q_heads must be a multiple of num_kv_heads");
  const at::Tensor q = query.contiguous();
  const at::Tensor tables = block_tables.to(at::kInt).contiguous();
  const at::Tensor lens = context_lens.to(at::kInt).contiguous();
  const int64_t num_seqs = q.size(0), num_q_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_q_heads / num_kv_heads;
  const int64_t max_blocks = tables.size(1);
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == num_seqs && lens.numel() == num_seqs,
              "block_tables / context_lens do not match the number of sequences");
  // Validate every block id a context can reach before any thread dereferences one.
  const int64_t num_blocks = k_cache.size(0);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = lens.data_ptr<int32_t>()[s];
    TORCH_CHECK(len >= 1 && len <= max_blocks * block_size, "bad context length ", len);
    for (int64_t b = 0; b < (len + block_size - 1) / block_size; ++b) {
      const int64_t block = tables.data_ptr<int32_t>()[s * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " out of range");
    }
  }
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * token_stride;
  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  // One work item per (sequence, kv head): its K/V rows are read once for the whole GQA group.
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(group * head_dim);
    std::vector<float> denom(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t len = lp[seq];
      const float* q_group = qp + (seq * num_q_heads + kv_head * group) * head_dim;
      scores.assign(group * len, 0.0f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t block = tp[seq * max_blocks + t / block_size];
        const float* k = kp + block * block_stride + (t % block_size) * token_stride +
                         kv_head * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qq = q_group + g * head_dim;
          float dot = 0.0f;
          for (int64_t d = 0; d < head_dim; ++d) dot += qq[d] * k[d];
          scores[g * len + t] = dot * fscale;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores.data() + g * len;
        const float max_score = *std::max_element(row, row + len);
        float sum = 0.0f;
        for (int64_t t = 0; t < len; ++t) {
          row[t] = std::exp(row[t] - max_score);
          sum += row[t];
        }
        denom[g] = sum;
      }
      for (int64_t t = 0; t < len; ++t) {
        const int64_t block = tp[seq * max_blocks + t / block_size];
        const float* v = vp + block * block_stride + (t % block_size) * token_stride +
                         kv_head * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* a = acc.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * v[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* o = op + (seq * num_q_heads + kv_head * group + g) * head_dim;
        const float inv = 1.0f / denom[g];
        for (int64_t d = 0; d < head_dim; ++d) o[d] = acc[g * head_dim + d] * inv;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve_cpu, m) {
  m.def("paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
