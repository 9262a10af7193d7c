// Paged decode attention for CPU: reads each sequence's K/V blocks in place, once, and
// accumulates in fp32. Caches of fp32 are read as they are; bf16 and fp16 rows are widened to
// fp32 as they are read (the query too; the output is rounded back to the query's dtype, as
// torch's fused CPU attention does). A quantized cache's rows are decoded (codebook[code] *
// scale) as they are read.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

void check_tables(const at::Tensor& tables, const at::Tensor& lens, int64_t num_seqs,
                  int64_t block_size, int64_t num_blocks) {
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == num_seqs && lens.numel() == num_seqs,
              "block_tables / context_lens do not match the number of sequences");
  // Validate every block id a context can reach before any thread dereferences one.
  const int64_t max_blocks = tables.size(1);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = lens.data_ptr<int32_t>()[s];
    TORCH_CHECK(len >= 1 && len <= max_blocks * block_size, "bad context length ", len);
    for (int64_t b = 0; b < (len + block_size - 1) / block_size; ++b) {
      const int64_t block = tables.data_ptr<int32_t>()[s * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " out of range");
    }
  }
}

// The attention itself, over rows that `Rows` yields: `rows.key(block, offset, kv_head, tmp)`
// returns head_dim floats (the cache row in place, or its dequantized copy in tmp).
template <typename Rows>
at::Tensor attend(const at::Tensor& q, const at::Tensor& tables, const at::Tensor& lens,
                  int64_t block_size, int64_t num_kv_heads, double scale, const Rows& rows) {
  const int64_t num_seqs = q.size(0), num_q_heads = q.size(1), head_dim = q.size(2);
  const int64_t group = num_q_heads / num_kv_heads;
  const int64_t max_blocks = tables.size(1);
  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  // One work item per (sequence, kv head): its K/V rows are read once for the whole GQA group.
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(group * head_dim);
    std::vector<float> denom(group);
    std::vector<float> tmp(head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t len = lp[seq];
      const float* q_group = qp + (seq * num_q_heads + kv_head * group) * head_dim;
      scores.assign(group * len, 0.0f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t block = tp[seq * max_blocks + t / block_size];
        const float* k = rows.key(block, t % block_size, kv_head, tmp.data());
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
        const float* v = rows.value(block, t % block_size, kv_head, tmp.data());
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

// Full-precision rows of contiguous [num_blocks, block_size, heads, head_dim] caches: fp32 in
// place, 16-bit ones widened into tmp.
template <typename T>
struct DenseRows {
  const T* k;
  const T* v;
  int64_t block_stride, token_stride, head_dim;
  const float* load(const T* base, int64_t b, int64_t t, int64_t h, float* tmp) const {
    const T* row = base + b * block_stride + t * token_stride + h * head_dim;
    if constexpr (std::is_same_v<T, float>) {
      return row;
    } else {
      for (int64_t d = 0; d < head_dim; ++d) tmp[d] = static_cast<float>(row[d]);
      return tmp;
    }
  }
  const float* key(int64_t b, int64_t t, int64_t h, float* tmp) const {
    return load(k, b, t, h, tmp);
  }
  const float* value(int64_t b, int64_t t, int64_t h, float* tmp) const {
    return load(v, b, t, h, tmp);
  }
};

// Byte codes [num_blocks, block_size, heads, head_dim] and float32 scales [num_blocks,
// block_size, heads], both strided views of the byte cache: row = codebook[code] * scale.
struct CodeRows {
  const uint8_t* k;
  const uint8_t* v;
  const float* ks;
  const float* vs;
  const float* book;
  int64_t code_strides[3], scale_strides[3], head_dim;
  const float* decode(const uint8_t* c, const float* s, int64_t b, int64_t t, int64_t h,
                      float* tmp) const {
    const uint8_t* row = c + b * code_strides[0] + t * code_strides[1] + h * code_strides[2];
    const float scale = s[b * scale_strides[0] + t * scale_strides[1] + h * scale_strides[2]];
    for (int64_t d = 0; d < head_dim; ++d) tmp[d] = book[row[d]] * scale;
    return tmp;
  }
  const float* key(int64_t b, int64_t t, int64_t h, float* tmp) const {
    return decode(k, ks, b, t, h, tmp);
  }
  const float* value(int64_t b, int64_t t, int64_t h, float* tmp) const {
    return decode(v, vs, b, t, h, tmp);
  }
};

void check_query(const at::Tensor& query, const at::Tensor& k_cache) {
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "paged_decode_attention: float32, bfloat16 or float16 query");
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu(),
              "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && query.size(2) == k_cache.size(3),
              "query [S, Hq, D] / cache [N, B, Hkv, D] mismatch");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "num_q_heads must be a multiple of num_kv_heads");
}

at::Tensor paged_decode_attention(
    const at::Tensor& query,         // [num_seqs, num_q_heads, head_dim]
    const at::Tensor& k_cache,       // [num_blocks, block_size, num_kv_heads, head_dim]
    const at::Tensor& v_cache,       // same
    const at::Tensor& block_tables,  // [num_seqs, max_blocks] int32
    const at::Tensor& context_lens,  // [num_seqs] int32
    double scale) {
  check_query(query, k_cache);
  TORCH_CHECK(k_cache.scalar_type() == query.scalar_type() &&
              v_cache.scalar_type() == query.scalar_type(),
              "paged_decode_attention: caches of the query's dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "k_cache / v_cache shapes differ");
  const at::Tensor q = query.to(at::kFloat).contiguous();
  const at::Tensor tables = block_tables.to(at::kInt).contiguous();
  const at::Tensor lens = context_lens.to(at::kInt).contiguous();
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  check_tables(tables, lens, q.size(0), block_size, k_cache.size(0));
  const int64_t head_dim = q.size(2), token_stride = num_kv_heads * head_dim;
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    const DenseRows<T> rows{k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                            block_size * token_stride, token_stride, head_dim};
    return attend(q, tables, lens, block_size, num_kv_heads, scale, rows);
  };
  switch (k_cache.scalar_type()) {
    case at::kBFloat16:
      return run(c10::BFloat16()).to(at::kBFloat16);
    case at::kHalf:
      return run(c10::Half()).to(at::kHalf);
    default:
      return run(0.0f);
  }
}

at::Tensor paged_decode_attention_quantized(
    const at::Tensor& query,         // [num_seqs, num_q_heads, head_dim] float32
    const at::Tensor& k_codes,       // [num_blocks, block_size, num_kv_heads, head_dim] uint8
    const at::Tensor& v_codes,       // same strides
    const at::Tensor& k_scales,      // [num_blocks, block_size, num_kv_heads] float32
    const at::Tensor& v_scales,      // same strides
    const at::Tensor& codebook,      // [256] float32
    const at::Tensor& block_tables,  // [num_seqs, max_blocks] int32
    const at::Tensor& context_lens,  // [num_seqs] int32
    double scale) {
  check_query(query, k_codes);
  TORCH_CHECK(query.scalar_type() == at::kFloat, "a quantized cache here: float32 query only");
  TORCH_CHECK(k_codes.scalar_type() == at::kByte && v_codes.scalar_type() == at::kByte,
              "quantized caches hold uint8 codes");
  TORCH_CHECK(k_scales.scalar_type() == at::kFloat && v_scales.scalar_type() == at::kFloat &&
              codebook.scalar_type() == at::kFloat && codebook.numel() == 256 &&
              codebook.is_contiguous(), "scales and the 256-entry codebook are float32");
  TORCH_CHECK(v_codes.sizes() == k_codes.sizes() && v_codes.strides() == k_codes.strides() &&
              k_codes.stride(3) == 1, "code views must match, with a contiguous head_dim");
  TORCH_CHECK(k_scales.dim() == 3 && k_scales.sizes() == k_codes.sizes().slice(0, 3) &&
              v_scales.sizes() == k_scales.sizes() && v_scales.strides() == k_scales.strides(),
              "scale views must be [num_blocks, block_size, num_kv_heads]");
  const at::Tensor q = query.contiguous();
  const at::Tensor tables = block_tables.to(at::kInt).contiguous();
  const at::Tensor lens = context_lens.to(at::kInt).contiguous();
  const int64_t block_size = k_codes.size(1), num_kv_heads = k_codes.size(2);
  check_tables(tables, lens, q.size(0), block_size, k_codes.size(0));
  const CodeRows rows{k_codes.data_ptr<uint8_t>(), v_codes.data_ptr<uint8_t>(),
                      k_scales.data_ptr<float>(), v_scales.data_ptr<float>(),
                      codebook.data_ptr<float>(),
                      {k_codes.stride(0), k_codes.stride(1), k_codes.stride(2)},
                      {k_scales.stride(0), k_scales.stride(1), k_scales.stride(2)},
                      q.size(2)};
  return attend(q, tables, lens, block_size, num_kv_heads, scale, rows);
}

}  // namespace

TORCH_LIBRARY(pdserve_cpu, m) {
  m.def("paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor context_lens, float scale) -> Tensor");
  m.def("paged_decode_attention_quantized(Tensor query, Tensor k_codes, Tensor v_codes, "
        "Tensor k_scales, Tensor v_scales, Tensor codebook, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_decode_attention_quantized", &paged_decode_attention_quantized);
}
