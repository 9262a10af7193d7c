// Paged decode attention for CPU: reads each sequence's K/V blocks in place, once, and
// accumulates in fp32 (split into spans across threads, as flash-decoding does). Dense caches
// take the AVX-512 span of decode_span.cpp where the build has it (a bf16 cache AMX's, in
// decode_span_amx.cpp, where the CPU has that); these loops are the portable path. Caches of
// fp32 are read as they are; bf16 and fp16 rows are widened to fp32 as they are read (the
// query too; the output is rounded back to the query's dtype, as torch's fused CPU attention
// does). A quantized cache's rows are decoded (codebook[code] *
// scale) as they are read.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu_ops.h"
#include "decode_span.h"

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

// How many tokens ahead of the one being read the kernel prefetches. Decode reads each
// sequence's blocks from wherever the allocator put them, cold: without prefetching the loop
// waits on DRAM latency for every row, not on bandwidth.
constexpr int64_t kPrefetchAhead = 8;

// One sequence's context cut into spans of whole blocks (flash-decoding): small batches and
// long contexts still give every thread work. Span `i` of sequence `s` is work item
// first_item[s] + i. A span is a fixed number of tokens, whatever the batch and the thread
// count: a sequence's partial sums, and the order they merge in, are its own, so its output
// is the same bits in any batch (a bf16 output would otherwise move by a rounding now and
// then with the batch around it).
struct Spans {
  int64_t span_tokens;
  std::vector<int64_t> first_item;  // num_seqs + 1 prefix sums

  Spans(const int32_t* lens, int64_t num_seqs, int64_t block_size) : first_item(num_seqs + 1) {
    // 64 tokens (whole blocks): a 300-token context is five items for the threads, and the
    // merge of the partial results stays cheap.
    constexpr int64_t kSpanTokens = 64;
    span_tokens = std::max<int64_t>(1, kSpanTokens / block_size) * block_size;
    for (int64_t s = 0; s < num_seqs; ++s)
      first_item[s + 1] = first_item[s] + (lens[s] + span_tokens - 1) / span_tokens;
  }
  int64_t num_items() const { return first_item.back(); }
  int64_t seq_of(int64_t item) const {
    return std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
  }
};

// The attention itself, over rows that `Rows` yields: `rows.row(is_key, block, offset, kv_head,
// tmp)` returns head_dim floats (the cache row in place, or its widened / dequantized copy in tmp).
// A work item is one span of one sequence, all heads at once (a token's rows for every kv
// head lie side by side, so the span is read front to back); it leaves, per query head, the
// running max, the sum of exp(score - max) and the unnormalised output, which a second pass
// merges. A sequence of one span is normalised exactly as a single pass would.
// The inputs as the kernel reads them, and its fp32 output in bf16, converted here rather
// than by Tensor::to (pdserve::empty_cpu says why): int32 tables and lengths, an fp32 query,
// all contiguous. bf16 <-> fp32 by c10::BFloat16 (round to nearest even): torch's bits for
// every number; a NaN comes out 0x7FC0, where torch's AVX-512 conversion writes 0xFFFF.
at::Tensor int_rows(const at::Tensor& t) {
  if (t.scalar_type() == at::kInt && t.is_contiguous()) return t;
  return t.to(at::kInt).contiguous();
}

template <typename T>
void widen_rows(const at::Tensor& query, float* dst) {
  const int64_t seqs = query.size(0), heads = query.size(1), dim = query.size(2);
  const T* src = query.data_ptr<T>();
  const int64_t s0 = query.stride(0), s1 = query.stride(1), s2 = query.stride(2);
  for (int64_t s = 0; s < seqs; ++s)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < dim; ++i)
        *dst++ = static_cast<float>(src[s * s0 + h * s1 + i * s2]);
}

at::Tensor float_rows(const at::Tensor& query) {
  const at::ScalarType dtype = query.scalar_type();
  if (dtype == at::kFloat && query.is_contiguous()) return query;
  if (dtype != at::kFloat && dtype != at::kBFloat16) return query.to(at::kFloat).contiguous();
  at::Tensor q = pdserve::empty_cpu(query.sizes(), at::kFloat);
  if (dtype == at::kFloat) {
    widen_rows<float>(query, q.data_ptr<float>());
  } else {
    widen_rows<c10::BFloat16>(query, q.data_ptr<float>());
  }
  return q;
}

at::Tensor bf16_rows(const at::Tensor& out) {  // contiguous fp32, as attend leaves it
  at::Tensor y = pdserve::empty_cpu(out.sizes(), at::kBFloat16);
  const float* src = out.data_ptr<float>();
  auto* dst = y.data_ptr<c10::BFloat16>();
  for (int64_t i = 0, n = out.numel(); i < n; ++i) dst[i] = c10::BFloat16(src[i]);
  return y;
}

template <typename Rows>
at::Tensor attend(const at::Tensor& q, const at::Tensor& tables, const at::Tensor& lens,
                  int64_t block_size, int64_t num_kv_heads, double scale, const Rows& rows) {
  const int64_t num_seqs = q.size(0), num_q_heads = q.size(1), head_dim = q.size(2);
  const int64_t group = num_q_heads / num_kv_heads;
  const int64_t max_blocks = tables.size(1);
  at::Tensor out = pdserve::empty_cpu(q.sizes(), q);
  const float* qp = q.data_ptr<float>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const Spans spans(lp, num_seqs, block_size);
  const int64_t part_size = head_dim + 2;  // max, sum, acc[head_dim]
  // Every span writes its whole part (max, sum, then its outputs, zero-filled or stored), so
  // the buffer is left unfilled: zeroing it cost ~10 us a call at batch 32.
  const std::unique_ptr<float[]> parts(new float[spans.num_items() * num_q_heads * part_size]);
  bool fast = false;  // the hand-vectorised span (decode_span.cpp) where this build has one
  if constexpr (Rows::kDense) fast = pdserve::decode_span_supported(Rows::kDtype, head_dim);

  at::parallel_for(0, spans.num_items(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> tmp(num_kv_heads * head_dim);
    std::vector<const float*> row(num_kv_heads);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = spans.seq_of(item);
      const int64_t t0 = (item - spans.first_item[seq]) * spans.span_tokens;
      const int64_t t1 = std::min<int64_t>(lp[seq], t0 + spans.span_tokens);
      const int64_t n = t1 - t0;
      const int32_t* table = tp + seq * max_blocks;
      const float* q_seq = qp + seq * num_q_heads * head_dim;
      float* part = parts.get() + item * num_q_heads * part_size;
      scores.resize(num_q_heads * n);
      if constexpr (Rows::kDense) {
        if (fast) {
          pdserve::DecodeSpan span{q_seq, rows.k, rows.v, table, block_size,
                                   num_kv_heads, group, head_dim, t0, t1, fscale,
                                   scores.data(), part};
          span.prefetched = item > begin;
          span.new_query = item == begin || spans.first_item[seq] == item;
          if (item + 1 < end) {  // this thread's next span, fetched while this one computes
            const int64_t next_seq = spans.seq_of(item + 1);
            span.next_table = tp + next_seq * max_blocks;
            span.next_t0 = (item + 1 - spans.first_item[next_seq]) * spans.span_tokens;
            span.next_t1 = std::min<int64_t>(lp[next_seq], span.next_t0 + spans.span_tokens);
          }
          pdserve::decode_span(Rows::kDtype, span);
          continue;
        }
      }
      // Points row[h] at token t's key (or value) row of every kv head, prefetching ahead.
      const auto read = [&](int64_t t, bool key) {
        if (t + kPrefetchAhead < t1) {
          const int64_t ahead = t + kPrefetchAhead;
          rows.prefetch(key, table[ahead / block_size], ahead % block_size);
        }
        const int64_t block = table[t / block_size];
        for (int64_t h = 0; h < num_kv_heads; ++h)
          row[h] = rows.row(key, block, t % block_size, h, tmp.data() + h * head_dim);
      };
      for (int64_t t = t0; t < t1; ++t) {
        read(t, true);
        for (int64_t qh = 0; qh < num_q_heads; ++qh) {
          const float* qq = q_seq + qh * head_dim;
          const float* k = row[qh / group];
          float dot = 0.0f;
          for (int64_t d = 0; d < head_dim; ++d) dot += qq[d] * k[d];
          scores[qh * n + (t - t0)] = dot * fscale;
        }
      }
      for (int64_t qh = 0; qh < num_q_heads; ++qh)
        pdserve::softmax_span(scores.data() + qh * n, n, part + qh * part_size, head_dim);
      for (int64_t t = t0; t < t1; ++t) {
        read(t, false);
        for (int64_t qh = 0; qh < num_q_heads; ++qh) {
          const float w = scores[qh * n + (t - t0)];
          const float* v = row[qh / group];
          float* a = part + qh * part_size + 2;
          for (int64_t d = 0; d < head_dim; ++d) a[d] += w * v[d];
        }
      }
    }
  });

  // Merge each (sequence, query head)'s spans: weight span i by exp(max_i - max).
  at::parallel_for(0, num_seqs * num_q_heads, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t seq = i / num_q_heads, qh = i % num_q_heads;
      const int64_t first = spans.first_item[seq], last = spans.first_item[seq + 1];
      const auto part = [&](int64_t item) {
        return parts.get() + (item * num_q_heads + qh) * part_size;
      };
      float* o = op + i * head_dim;
      if (last - first == 1) {
        const float* p = part(first);
        const float inv = 1.0f / p[1];
        for (int64_t d = 0; d < head_dim; ++d) o[d] = p[2 + d] * inv;
        continue;
      }
      float max_score = -INFINITY;
      for (int64_t item = first; item < last; ++item) max_score = std::max(max_score, part(item)[0]);
      float sum = 0.0f;
      std::fill(o, o + head_dim, 0.0f);
      for (int64_t item = first; item < last; ++item) {
        const float* p = part(item);
        const float w = std::exp(p[0] - max_score);
        sum += w * p[1];
        for (int64_t d = 0; d < head_dim; ++d) o[d] += w * p[2 + d];
      }
      const float inv = 1.0f / sum;
      for (int64_t d = 0; d < head_dim; ++d) o[d] *= inv;
    }
  });
  return out;
}

// Full-precision rows of contiguous [num_blocks, block_size, heads, head_dim] caches: fp32 in
// place, 16-bit ones widened into tmp.
template <typename T>
struct DenseRows {
  static constexpr bool kDense = true;
  static constexpr c10::ScalarType kDtype = c10::CppTypeToScalarType<T>::value;
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
  const float* row(bool key, int64_t b, int64_t t, int64_t h, float* tmp) const {
    return load(key ? k : v, b, t, h, tmp);
  }
  // A token's rows for all kv heads are one run of token_stride elements.
  void prefetch(bool key, int64_t b, int64_t t) const {
    const T* base = key ? k : v;
    const char* run = reinterpret_cast<const char*>(base + b * block_stride + t * token_stride);
    const int64_t bytes = token_stride * static_cast<int64_t>(sizeof(T));
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(run + i);
  }
};

// Byte codes [num_blocks, block_size, heads, head_dim] and float32 scales [num_blocks,
// block_size, heads], both strided views of the byte cache: row = codebook[code] * scale.
struct CodeRows {
  static constexpr bool kDense = false;
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
  const float* row(bool key, int64_t b, int64_t t, int64_t h, float* tmp) const {
    return key ? decode(k, ks, b, t, h, tmp) : decode(v, vs, b, t, h, tmp);
  }
  // Codes are a quarter of a float row: the hardware prefetcher keeps up without help.
  void prefetch(bool, int64_t, int64_t) const {}
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
  const at::Tensor q = float_rows(query);
  const at::Tensor tables = int_rows(block_tables);
  const at::Tensor lens = int_rows(context_lens);
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
      return bf16_rows(run(c10::BFloat16()));
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
  const at::Tensor tables = int_rows(block_tables);
  const at::Tensor lens = int_rows(context_lens);
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

namespace pdserve {
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale) {
  return paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale);
}
}  // namespace pdserve

namespace {
// Whether a bf16 cache of this shape takes the AMX span here (tests ask, to know which path
// they checked).
bool decode_attention_amx_applies(int64_t block_size, int64_t head_dim, int64_t num_q_heads) {
  return pdserve::decode_span_amx_supported(block_size, head_dim, num_q_heads);
}
}  // namespace

TORCH_LIBRARY(pdserve_cpu, m) {
  m.def("decode_attention_amx_applies(int block_size, int head_dim, int num_q_heads) -> bool",
        decode_attention_amx_applies);
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
