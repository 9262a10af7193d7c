// The AVX-512 decode span (see decode_span.h). Scores: 16 tokens at a time, each query head
// dotted with its kv head's key rows (bf16 rows as they lie, by vdpbf16ps; fp32 and fp16 ones
// widened per dot) and the 16 dots summed in one transposing reduction. Values: each kv head
// in turn with the query heads that share it (GQA): a value row is widened once and
// accumulated into every head's output, which stays in registers for the whole span.
#include "decode_span.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pdserve {

#if defined(__AVX512F__)
namespace {

// Rows are wherever the allocator put them, so fetch ahead: a bf16 token of SmolLM2 is 6
// cache lines, and 16 tokens ahead measured best (8 left the loop waiting on DRAM).
constexpr int64_t kPrefetchAhead = 16;
// Query heads held in registers at once: 4 heads x 8 vectors (head_dim 128) + a row fit in
// the 32 zmm registers.
constexpr int64_t kMaxGroup = 4;

template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // bf16 is the top half of an fp32: widening is exact.
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

template <typename T, int D>
struct Rows {
  const T* base;
  const int64_t* offset;  // token t's row of every kv head: base + offset[t - t0]
  int64_t t0, row_bytes;
  const T* token(int64_t t) const { return base + offset[t - t0]; }
  void prefetch(int64_t t) const {
    const char* run = reinterpret_cast<const char*>(token(t));
    for (int64_t i = 0; i < row_bytes; i += 64) _mm_prefetch(run + i, _MM_HINT_T0);
  }
  // Into L2 only: its miss queue holds three times L1's, so fetching far ahead this way
  // keeps more lines in flight than L1's fill buffers can (where those run out, a prefetch
  // stalls the loop that asked for it).
  void prefetch_l2(int64_t t) const {
    const char* run = reinterpret_cast<const char*>(token(t));
    for (int64_t i = 0; i < row_bytes; i += 64) _mm_prefetch(run + i, _MM_HINT_T1);
  }
  // Token t's row of kv head h, widened into out[D / 16] (prefetching ahead when asked).
  void load(int64_t t, int64_t t1, int64_t h, bool ahead, __m512* out) const {
    if (ahead && t + kPrefetchAhead < t1) prefetch(t + kPrefetchAhead);
    const T* row = token(t) + h * D;
    for (int i = 0; i < D / 16; ++i) out[i] = load16(row + 16 * i);
  }
};

// Unnormalised outputs of the same heads: sum over the span of exp-weight x value row.
template <typename T, int D, int G>
void values_for(const Rows<T, D>& values, const DecodeSpan& s, int64_t h, int64_t qh0, bool ahead) {
  constexpr int V = D / 16;
  const int64_t n = s.t1 - s.t0;
  __m512 acc[G][V];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < V; ++i) acc[g][i] = _mm512_setzero_ps();
  for (int64_t t = s.t0; t < s.t1; ++t) {
    __m512 v[V];
    values.load(t, s.t1, h, ahead, v);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(s.scores[(qh0 + g) * n + (t - s.t0)]);
      for (int i = 0; i < V; ++i) acc[g][i] = _mm512_fmadd_ps(w, v[i], acc[g][i]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < V; ++i)
      _mm512_storeu_ps(s.part + (qh0 + g) * (D + 2) + 2 + 16 * i, acc[g][i]);
}

// Calls pass<G>(h, qh0) for every kv head h and every chunk of at most kMaxGroup of its
// query heads; the first chunk of the first head prefetches (the others find rows in cache).
template <typename Pass>
void for_chunks(const DecodeSpan& s, const Pass& pass) {
  for (int64_t h = 0; h < s.num_kv_heads; ++h) {
    for (int64_t c = 0; c < s.group; c += kMaxGroup) {
      const int64_t qh0 = h * s.group + c;
      const bool ahead = h == 0 && c == 0;
      switch (std::min(kMaxGroup, s.group - c)) {
        case 1: pass(std::integral_constant<int, 1>{}, h, qh0, ahead); break;
        case 2: pass(std::integral_constant<int, 2>{}, h, qh0, ahead); break;
        case 3: pass(std::integral_constant<int, 3>{}, h, qh0, ahead); break;
        default: pass(std::integral_constant<int, 4>{}, h, qh0, ahead); break;
      }
    }
  }
}

// Sums each of 16 vectors' lanes at once, a transpose as it adds (45 shuffles and adds for 16
// dot products, where a horizontal sum each is ~8 dependent ones): lane l of the result is
// the sum of v[l / 4 + 4 * (l % 4)].
inline __m512 sum16(const __m512* v) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: v[2i]'s halves added; 8-15: v[2i + 1]'s
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarter q: v[4i + q]'s four partial sums
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // quarter q: v[8i + q]'s two, v[8i + 4 + q]'s two
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88),
                       _mm512_shuffle_ps(y[0], y[1], 0xDD));
}

#if defined(__AVX512BF16__)
// One query head's dot with one bf16 key row: `vdpbf16ps` takes the row as it lies (pairs of
// dims), so nothing is widened. A bf16 query is exact as bf16 pairs, and each product of two
// bf16 is exact in fp32: only the order of the fp32 sums differs from the widening path.
template <int D>
inline __m512 dot_bf16(const __m512bh* q, const c10::BFloat16* row) {
  __m512 acc = _mm512_setzero_ps();
  for (int p = 0; p < D / 32; ++p)
    acc = _mm512_dpbf16_ps(acc, q[p], (__m512bh)_mm512_loadu_si512(row + 32 * p));
  return acc;
}

#endif

// One query head's dot with a key row of an fp32 or fp16 cache, widened: 16 lanes for sum16.
template <typename T, int D>
inline __m512 dot_wide(const float* q, const T* row) {
  __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), load16(row));
  for (int i = 1; i < D / 16; ++i)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * i), load16(row + 16 * i), acc);
  return acc;
}

// The scores pass: 16 tokens at a time, every head of each token while its row is in L1, one
// transposing sum per (16 tokens, query head), where a horizontal sum per score cost ~10
// vector instructions of this CPU's scarce vector throughput (fp32 at batch 32: most of the
// pass). It fetches keys and values two chunks ahead into L2, so the values pass finds its
// rows there. The chunks start at the span's first token, and spans are fixed by the context
// alone: a score's sum order does not depend on the batch.
template <typename T, int D>
void scores16(const Rows<T, D>& keys, const Rows<T, D>& values, const DecodeSpan& s) {
  const int64_t n = s.t1 - s.t0, heads = s.num_kv_heads * s.group;
#if defined(__AVX512BF16__)
  // bf16: vdpbf16ps takes the row as it lies; the query is packed to bf16 pairs once.
  constexpr int P = D / 32;
  thread_local std::vector<__m512bh> qb;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    qb.resize(heads * P);
    for (int64_t qh = 0; qh < heads; ++qh)
      for (int p = 0; p < P; ++p) {
        const float* src = s.q + qh * D + 32 * p;
        qb[qh * P + p] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
      }
  }
#endif
  auto dot = [&](int64_t qh, const T* row) {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) return dot_bf16<D>(&qb[qh * P], row);
#endif
    return dot_wide<T, D>(s.q + qh * D, row);
  };
  const __m512 scale = _mm512_set1_ps(s.scale);
  int64_t t = s.t0;
  for (int64_t a = t + 16; a < std::min(s.t1, t + 32); ++a) {
    keys.prefetch_l2(a);
    values.prefetch_l2(a);
  }
  for (; t + 16 <= s.t1; t += 16) {
    for (int64_t a = t + 32; a < std::min(s.t1, t + 48); ++a) {
      keys.prefetch_l2(a);
      values.prefetch_l2(a);
    }
    const T* rows[16];
    for (int j = 0; j < 16; ++j) rows[j] = keys.token(t + j);
    for (int64_t h = 0; h < s.num_kv_heads; ++h)
      for (int64_t qh = h * s.group; qh < (h + 1) * s.group; ++qh) {
        __m512 acc[16];
        for (int j = 0; j < 16; ++j)  // token j into the slot whose sum lands in lane j
          acc[j / 4 + 4 * (j % 4)] = dot(qh, rows[j] + h * D);
        _mm512_storeu_ps(s.scores + qh * n + (t - s.t0), _mm512_mul_ps(sum16(acc), scale));
      }
  }
  for (; t < s.t1; ++t)
    for (int64_t qh = 0; qh < heads; ++qh) {
      const T* row = keys.token(t) + (qh / s.group) * D;
      s.scores[qh * n + (t - s.t0)] = _mm512_reduce_add_ps(dot(qh, row)) * s.scale;
    }
}

template <typename T, int D>
void run(const DecodeSpan& s) {
  const int64_t token_stride = s.num_kv_heads * D;
  // Where each token's rows lie, once per span: the block table's division, done per row
  // read (every head, both passes, the prefetch) cost more than the arithmetic.
  thread_local std::vector<int64_t> offsets;
  offsets.resize(s.t1 - s.t0);
  row_offsets(s.table, s.block_size, token_stride, s.t0, s.t1 - s.t0, offsets.data());
  const int64_t row_bytes = token_stride * static_cast<int64_t>(sizeof(T));
  const Rows<T, D> keys{static_cast<const T*>(s.k), offsets.data(), s.t0, row_bytes};
  const Rows<T, D> values{static_cast<const T*>(s.v), offsets.data(), s.t0, row_bytes};
  // Each pass prefetches kPrefetchAhead tokens ahead of the one it reads: the first ones of
  // both passes are asked for here, so neither starts on DRAM's latency (at batch 1 a span is
  // only two blocks).
  for (int64_t t = s.t0; t < std::min(s.t1, s.t0 + kPrefetchAhead); ++t) {
    keys.prefetch(t);
    values.prefetch(t);
  }
  scores16<T, D>(keys, values, s);
  const int64_t n = s.t1 - s.t0;
  for (int64_t qh = 0; qh < s.num_kv_heads * s.group; ++qh)
    softmax_span(s.scores + qh * n, n, s.part + qh * (D + 2), D);
  for_chunks(s, [&](auto g, int64_t h, int64_t qh0, bool ahead) {
    values_for<T, D, decltype(g)::value>(values, s, h, qh0, ahead);
  });
}

template <typename T>
void run_dim(const DecodeSpan& s) {
  if (s.head_dim == 64) {
    run<T, 64>(s);
  } else {
    run<T, 128>(s);
  }
}

}  // namespace

bool decode_span_supported(c10::ScalarType dtype, int64_t head_dim) {
  return (head_dim == 64 || head_dim == 128) &&
         (dtype == c10::kFloat || dtype == c10::kBFloat16 || dtype == c10::kHalf);
}

void decode_span(c10::ScalarType dtype, const DecodeSpan& span) {
  if (dtype == c10::kBFloat16 && span.t1 - span.t0 <= kAmxSpanTokens &&
      span.next_t1 - span.next_t0 <= kAmxSpanTokens &&
      decode_span_amx_supported(span.block_size, span.head_dim, span.num_kv_heads * span.group))
    return decode_span_amx(span);
  switch (dtype) {
    case c10::kBFloat16: return run_dim<c10::BFloat16>(span);
    case c10::kHalf: return run_dim<c10::Half>(span);
    default: return run_dim<float>(span);
  }
}

#else  // no AVX-512 in this build: the caller's portable loop does all the work

bool decode_span_supported(c10::ScalarType, int64_t) { return false; }
void decode_span(c10::ScalarType, const DecodeSpan&) {}

#endif

}  // namespace pdserve
