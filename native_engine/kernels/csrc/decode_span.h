// One work item of paged decode attention (one span of one sequence, every head) over a dense
// cache, vectorised by hand: paged_decode_attention_cpu.cpp calls it and falls back to its
// portable loops when it returns false (no AVX-512 at build time, an unsupported head_dim).
// A bf16 cache takes AMX's tiles where the CPU has them (decode_span_amx.cpp), AVX-512 else
// (decode_span.cpp).
#pragma once

#include <c10/core/ScalarType.h>

#include "vec_exp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pdserve {

struct DecodeSpan {
  const float* q;           // [num_q_heads, head_dim] fp32, this sequence's query
  const void* k;            // cache base, [num_blocks, block_size, num_kv_heads, head_dim]
  const void* v;            // same
  const int32_t* table;     // this sequence's block ids
  int64_t block_size, num_kv_heads, group, head_dim;
  int64_t t0, t1;           // token range [t0, t1) of this span
  float scale;
  float* scores;            // [num_q_heads, t1 - t0] scratch
  float* part;              // [num_q_heads, head_dim + 2]: max, sum, unnormalised output
  // The span this thread computes next (none where next_table is null): the AMX span fetches
  // its rows while it computes this one. `prefetched`: the span before fetched this one's.
  const int32_t* next_table = nullptr;
  int64_t next_t0 = 0, next_t1 = 0;
  bool prefetched = false;
  // False where the span this thread computed just before was the same sequence's: the AMX
  // span keeps the query it packed for that one.
  bool new_query = true;
};


// Element offsets of rows t0 .. t0 + n - 1 of a sequence (every kv head's row of a token) in
// a cache of `table`'s blocks, a block at a time (one division per block, not per row).
inline void row_offsets(const int32_t* table, int64_t block_size, int64_t token_stride,
                        int64_t t0, int64_t n, int64_t* out) {
  for (int64_t t = 0; t < n;) {
    const int64_t pos = t0 + t, in = pos % block_size;
    const int64_t m = std::min(block_size - in, n - t);
    const int64_t base = (table[pos / block_size] * block_size + in) * token_stride;
    for (int64_t i = 0; i < m; ++i) out[t + i] = base + i * token_stride;
    t += m;
  }
}

// Turns one query head's n raw scores into exp(score - max) in place and starts its part:
// part = [max, sum, 0 ... 0]. Both paths use it, so a span is normalised one way.
inline void softmax_span(float* scores, int64_t n, float* part, int64_t head_dim) {
  const float max_score = *std::max_element(scores, scores + n);
  float sum = 0.0f;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 max_v = _mm512_set1_ps(max_score);
  __m512 sum_v = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores + i), max_v));
    _mm512_storeu_ps(scores + i, e);
    sum_v = _mm512_add_ps(sum_v, e);
  }
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, scores + i), max_v));
    _mm512_mask_storeu_ps(scores + i, tail, e);
    sum_v = _mm512_add_ps(sum_v, _mm512_maskz_mov_ps(tail, e));
    i = n;
  }
  sum = _mm512_reduce_add_ps(sum_v);
#endif
  for (; i < n; ++i) {
    scores[i] = std::exp(scores[i] - max_score);
    sum += scores[i];
  }
  part[0] = max_score;
  part[1] = sum;
  std::fill(part + 2, part + 2 + head_dim, 0.0f);
}

// Whether this build has the fast path for caches of `dtype` with this head_dim.
bool decode_span_supported(c10::ScalarType dtype, int64_t head_dim);

// Fills span.part as the portable loop does (same layout; max and sum of the same scores);
// the order of the fp32 sums differs, and the AMX span weighs values by a bf16 hi + lo pair
// of each probability (about 16 bits of it) where the others use its fp32 value.
void decode_span(c10::ScalarType dtype, const DecodeSpan& span);

// The AMX span for a bf16 cache: whether this build and CPU have it for this shape, and the
// span itself, for spans (this one and the next) of at most kAmxSpanTokens tokens (decode_span
// checks both before calling it). Same part layout; see its file for the arithmetic.
constexpr int64_t kAmxSpanTokens = 128;
bool decode_span_amx_supported(int64_t block_size, int64_t head_dim, int64_t num_q_heads);
void decode_span_amx(const DecodeSpan& span);

}  // namespace pdserve
