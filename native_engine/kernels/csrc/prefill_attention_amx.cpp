// Paged prefill attention in bf16 on AMX: each prefill sequence's chunk of queries over its
// cached context (the chunk's own keys included, already stored), causal, grouped-query; all
// of a step's prefill sequences in one call (one parallel region each for packing and for
// the queries, every sequence's output rows written in place).
//
// Why not torch's SDPA: its result for a prompt row moves with how the prompt is chunked (and
// so with the step's token budget, a prefix-cache hit, or a re-prefill after a migration).
// Here a query row's result is a function of that row and its keys alone, whatever chunk or
// batch it comes in:
//   - each score is one AMX accumulation over head_dim, in k order;
//   - a row's max is the max of its own scores (exact, in any order), so its probabilities
//     are its own; keys past the row's position (and past the context) weigh exactly 0;
//   - its sum of probabilities is lane-wise over its keys in order, then one fixed reduction,
//     and its value product one AMX accumulation over its keys in order, 32 at a time.
// A block of queries may read more keys than one of its rows sees: they add exact zeros.
//
// The tiles: scores are S = Q K^T (query rows loaded in place; K packed once per call and kv
// head as the pairs of dims AMX's second operand takes), probabilities are rounded to bf16 for
// the value product (as torch's flash attention does in bf16), and O = P V takes V packed as
// pairs of keys. Scores and probabilities of a block of 16 queries are kept whole (16 rows of
// the context), which suits prompts and chunks up to some thousands of keys.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "amx_tiles.h"
#include "bf16.h"
#include "vec_exp.h"
#define PDSERVE_PREFILL_AMX 1
#endif

namespace {

constexpr int64_t kSpan = 32;    // keys per k-step of the value product
constexpr int64_t kRows = 16;    // queries per block, keys per score tile, dims per output tile
constexpr int64_t kDChunk = 32;  // head_dim per k-step of the scores
// The max's starting value. Finite: the build is -ffast-math, under which infinities are not
// safe. (A masked key's exp may overflow in its lane; the lane is zeroed before any use.)
constexpr float kMasked = -1e30f;

#if defined(PDSERVE_PREFILL_AMX)


struct Problem {
  const uint16_t* q;   // [q_len, heads, dim] at row stride ldq
  int64_t ldq;
  uint16_t* kp;  // K per 16-key tile: [kv_heads][tiles][dim / 32][16 dim pairs][16][2]
  uint16_t* vp;  // V per span: [kv_heads][spans][16 key pairs][dim][2]
  uint16_t* out;       // [q_len, heads, dim]
  int64_t q_len, heads, kv_heads, dim, context_len, spans;
  float scale;

  int64_t offset() const { return context_len - q_len; }  // query 0's position
  int64_t padded() const { return spans * kSpan; }        // keys a score row holds
  int64_t chunks() const { return dim / kDChunk; }
};


// A thread's rows of one block of queries: padded() keys each.
struct Scratch {
  std::vector<float> scores;    // [16 queries][padded]
  std::vector<uint16_t> probs;  // [16 queries][padded] bf16
  std::vector<uint16_t> short_block;  // [16][dim]: the queries of a block of fewer than 16
};

// S = Q K^T for 16 queries (rows from q at byte stride ldq) over `spans` spans, a span (two
// 16-key tiles, accumulators 0 and 1) at a time.
void scores_of(const Problem& pb, const uint16_t* q, int64_t ldq, const uint16_t* kp,
               int64_t spans, float* scores) {
  const int64_t chunks = pb.chunks(), tile = kRows * kRows * 2;
  for (int64_t s = 0; s < spans; ++s) {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t c = 0; c < chunks; ++c) {
      _tile_loadd(2, q + c * kDChunk, ldq);
      const uint16_t* k0 = kp + (2 * s * chunks + c) * tile;
      _tile_loadd(4, k0, 64);
      _tile_loadd(5, k0 + chunks * tile, 64);
      _tile_dpbf16ps(0, 2, 4);
      _tile_dpbf16ps(1, 2, 5);
    }
    _tile_stored(0, scores + s * kSpan, pb.padded() * 4);
    _tile_stored(1, scores + s * kSpan + kRows, pb.padded() * 4);
  }
}

// One row: mask (keys past `pos` weigh exactly 0), max, probabilities as bf16 and their fp32
// sum, lane-wise in key order, then reduced. Returns 1 / the sum. The scale goes into the
// exp's argument, 2^((s - max) scale log2 e) as one fused op (scale > 0, so the max of the
// raw scores is the max of the scaled ones), and only the chunks reaching past `pos` are
// masked: a softmax is ~14 vector instructions a 16 keys, not ~28.
float softmax_row(float* row, uint16_t* probs, int64_t keys, int64_t pos, float scale) {
  const __m512 masked = _mm512_set1_ps(kMasked);
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i last = _mm512_set1_epi32(static_cast<int32_t>(pos));
  auto live = [&](int64_t k) {
    const __m512i key = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(k)));
    return _mm512_cmp_epi32_mask(key, last, _MM_CMPINT_LE);
  };
  const int64_t whole = std::min(keys, (pos + 1) / kRows * kRows);  // chunks all live
  __m512 mv = masked;
  int64_t k = 0;
  for (; k < whole; k += kRows) mv = _mm512_max_ps(mv, _mm512_loadu_ps(row + k));
  for (; k < keys; k += kRows) mv = _mm512_mask_max_ps(mv, live(k), mv, _mm512_loadu_ps(row + k));
  const float c = scale * pdserve::kLog2e;
  const __m512 cv = _mm512_set1_ps(c), mc = _mm512_set1_ps(_mm512_reduce_max_ps(mv) * c);
  __m512 sum = _mm512_setzero_ps();
  for (k = 0; k < keys; k += kRows) {
    __m512 p = pdserve::exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(row + k), cv, mc));
    if (k >= whole) p = _mm512_maskz_mov_ps(live(k), p);
    sum = _mm512_add_ps(sum, p);
    // vcvtneps2bf16: to nearest even, denormals to 0 (a probability below 1e-38 is 0 here).
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + k), (__m256i)_mm512_cvtneps_pbh(p));
  }
  // A row always sees its own key, whose probability is ~1 (2^0 but for the max's rounding
  // in the fused op): the sum is ~>= 1.
  return 1.0f / _mm512_reduce_add_ps(sum);
}

// O = P V for 16 queries, four 16-dim blocks at a time (tiles 0-3) across every span, then
// out = O / sum, rounded to bf16.
void values_of(const Problem& pb, const uint16_t* probs, const uint16_t* vp, int64_t spans,
               const float* inv, int64_t rows, uint16_t* out, int64_t ldo) {
  alignas(64) float o[4 * kRows * kRows];
  const int64_t ldv = pb.dim * 4, dblocks = pb.dim / kRows;
  for (int64_t d0 = 0; d0 < dblocks; d0 += 4) {
    const int64_t nd = std::min<int64_t>(4, dblocks - d0);
    _tile_zero(0);
    if (nd > 1) _tile_zero(1);
    if (nd > 2) _tile_zero(2);
    if (nd > 3) _tile_zero(3);
    for (int64_t s = 0; s < spans; ++s) {
      _tile_loadd(4, probs + s * kSpan, pb.padded() * 2);
      const uint16_t* v = vp + (s * kRows * pb.dim + d0 * kRows) * 2;
      _tile_loadd(5, v, ldv);
      _tile_dpbf16ps(0, 4, 5);
      if (nd > 1) {
        _tile_loadd(6, v + kRows * 2, ldv);
        _tile_dpbf16ps(1, 4, 6);
      }
      if (nd > 2) {
        _tile_loadd(7, v + 2 * kRows * 2, ldv);
        _tile_dpbf16ps(2, 4, 7);
      }
      if (nd > 3) {
        _tile_loadd(5, v + 3 * kRows * 2, ldv);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
    _tile_stored(0, o, 64);
    if (nd > 1) _tile_stored(1, o + kRows * kRows, 64);
    if (nd > 2) _tile_stored(2, o + 2 * kRows * kRows, 64);
    if (nd > 3) _tile_stored(3, o + 3 * kRows * kRows, 64);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 inv_r = _mm512_set1_ps(inv[r]);
      for (int64_t d = 0; d < nd; ++d)
        pdserve::store_bf16x16(out + r * ldo + (d0 + d) * kRows,
                               _mm512_mul_ps(_mm512_load_ps(o + (d * kRows + r) * kRows), inv_r));
    }
  }
}

// One block of 16 queries (from i0) of one head over every key the block can see.
void query_block(const Problem& pb, int64_t head, int64_t i0, Scratch& sc) {
  const int64_t kvh = head / (pb.heads / pb.kv_heads);
  const int64_t rows = std::min(kRows, pb.q_len - i0);
  const int64_t last = pb.offset() + i0 + rows - 1;  // the block's last position
  const int64_t spans = last / kSpan + 1;
  const int64_t tile = kRows * kRows * 2;
  // A tile load reads 16 rows: a short block's are copied, zero-padded, first.
  const uint16_t* q = pb.q + i0 * pb.ldq + head * pb.dim;
  int64_t ldq = pb.ldq * 2;
  if (rows < kRows) {
    std::fill(sc.short_block.begin(), sc.short_block.end(), uint16_t{0});
    for (int64_t r = 0; r < rows; ++r)
      std::copy_n(q + r * pb.ldq, pb.dim, sc.short_block.data() + r * pb.dim);
    q = sc.short_block.data();
    ldq = pb.dim * 2;
  }
  scores_of(pb, q, ldq, pb.kp + kvh * pb.spans * 2 * pb.chunks() * tile, spans,
            sc.scores.data());
  alignas(64) float inv[kRows];
  for (int64_t r = 0; r < rows; ++r)
    inv[r] = softmax_row(sc.scores.data() + r * pb.padded(), sc.probs.data() + r * pb.padded(),
                         spans * kSpan, pb.offset() + i0 + r, pb.scale);
  for (int64_t r = rows; r < kRows; ++r) {  // rows past the chunk: zero probabilities
    std::fill_n(sc.probs.data() + r * pb.padded(), spans * kSpan, uint16_t{0});
    inv[r] = 0.0f;
  }
  values_of(pb, sc.probs.data(), pb.vp + kvh * pb.spans * kRows * pb.dim * 2, spans, inv, rows,
            pb.out + (i0 * pb.heads + head) * pb.dim, pb.heads * pb.dim);
}

// K and V as AMX's second operand takes them, for kv head h, span s: pairs of dims (K, for
// the scores) and of keys (V, for the value product) side by side. Positions past the context
// are written as zeros: a stale row may hold a NaN, and a zero probability times a NaN is a NaN.
void pack_span(const Problem& pb, const uint16_t* k_cache, const uint16_t* v_cache,
               const int64_t* ids, int64_t block_size, int64_t h, int64_t s) {
  const int64_t dim = pb.dim, pairs = dim / 2;
  const int64_t keys = std::min(kSpan, pb.context_len - s * kSpan);
  auto row = [&](const uint16_t* cache, int64_t t) {
    const int64_t pos = s * kSpan + t;
    return cache + ((ids[pos / block_size] * block_size + pos % block_size) * pb.kv_heads + h) * dim;
  };
  // K, a dword (two dims) at a time: tile 2s + t / 16 is [dim pair][key t % 16], its chunks of
  // 32 dims one after another, so dim pair j of key t lands at j * 16 + t % 16. Keys past the
  // context are zeros (the buffers are not cleared beforehand).
  auto* kt = reinterpret_cast<uint32_t*>(pb.kp) + (h * pb.spans * 2 + 2 * s) * pairs * kRows;
  for (int64_t t = 0; t < kSpan; ++t) {
    uint32_t* dst = kt + t / kRows * pairs * kRows + t % kRows;
    if (t < keys) {
      const auto* k = reinterpret_cast<const uint32_t*>(row(k_cache, t));
      for (int64_t j = 0; j < pairs; ++j) dst[j * kRows] = k[j];
    } else {
      for (int64_t j = 0; j < pairs; ++j) dst[j * kRows] = 0;
    }
  }
  // V, two keys at a time: key pair t / 2 is [dim][2], 16 dims a vector.
  uint16_t* vt = pb.vp + (h * pb.spans + s) * kRows * dim * 2;
  std::fill(vt + (keys + 1) / 2 * dim * 2, vt + kRows * dim * 2, uint16_t{0});
  for (int64_t t = 0; t < keys; t += 2) {
    const uint16_t* v0 = row(v_cache, t);
    auto* dst = reinterpret_cast<uint32_t*>(vt + t / 2 * dim * 2);
    for (int64_t d = 0; d < dim; d += kRows) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + d)));
      __m512i pair = lo;
      if (t + 1 < keys) {
        const __m512i hi = _mm512_cvtepu16_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row(v_cache, t + 1) + d)));
        pair = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
      }
      _mm512_storeu_si512(dst + d, pair);
    }
  }
}

#endif  // PDSERVE_PREFILL_AMX

const uint16_t* bf16_data(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

uint16_t* mutable_bf16(at::Tensor& t) {
  return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}

}  // namespace

bool prefill_attention_amx_built() {
#if defined(PDSERVE_PREFILL_AMX)
  return true;
#else
  return false;
#endif
}

// Sequence s's queries are query rows [query_starts[s], query_starts[s + 1]), at positions
// context_lens[s] - q_len .. context_lens[s] - 1 of its context, whose blocks are
// block_tables[s] (only the blocks the context covers are read).
at::Tensor paged_prefill_attention_bf16(const at::Tensor& query,    // [tokens, heads, dim]
                                        const at::Tensor& k_cache,  // [blocks, bs, kv_heads, dim]
                                        const at::Tensor& v_cache,
                                        const at::Tensor& block_tables,  // [seqs, width] int64
                                        const at::Tensor& query_starts,  // [seqs + 1] int64
                                        const at::Tensor& context_lens,  // [seqs] int64
                                        double scale) {
  TORCH_CHECK(prefill_attention_amx_built(), "paged_prefill_attention_bf16: built without AMX");
#if defined(PDSERVE_PREFILL_AMX)
  // Also asks the kernel for the tile state once: a tile op without it is SIGILL.
  TORCH_CHECK(pdserve::amx_permitted(), "paged_prefill_attention_bf16: this CPU or kernel "
              "does not let the process use AMX tiles");
#endif
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kBFloat16 && query.stride(2) == 1 &&
                  query.stride(1) == query.size(2),
              "paged_prefill_attention_bf16: query must be [tokens, heads, dim] bf16, rows whole");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == at::kBFloat16 &&
                  k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == at::kBFloat16 && v_cache.is_contiguous(),
              "paged_prefill_attention_bf16: caches must be contiguous bf16 [blocks, bs, kv, dim]");
  const int64_t tokens = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && dim % kDChunk == 0,
              "paged_prefill_attention_bf16: head_dim must be a multiple of 32");
  TORCH_CHECK(heads % kv_heads == 0, "paged_prefill_attention_bf16: heads % kv_heads != 0");
  TORCH_CHECK(scale > 0, "paged_prefill_attention_bf16: scale must be > 0, got ", scale);
  const int64_t seqs = block_tables.dim() == 2 ? block_tables.size(0) : -1;
  for (const at::Tensor* t : {&block_tables, &query_starts, &context_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "paged_prefill_attention_bf16: block_tables, query_starts and context_lens "
                "must be contiguous int64");
  TORCH_CHECK(seqs >= 1 && query_starts.dim() == 1 && query_starts.size(0) == seqs + 1 &&
                  context_lens.dim() == 1 && context_lens.size(0) == seqs,
              "paged_prefill_attention_bf16: block_tables [seqs, width], query_starts "
              "[seqs + 1], context_lens [seqs]");
  const int64_t width = block_tables.size(1);
  const int64_t *starts = query_starts.data_ptr<int64_t>(), *lens = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[seqs] == tokens,
              "paged_prefill_attention_bf16: query_starts must run from 0 to the query's ",
              tokens, " rows");
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t q_len = starts[s + 1] - starts[s];
    TORCH_CHECK(q_len >= 1 && lens[s] >= q_len && lens[s] <= width * block_size,
                "paged_prefill_attention_bf16: bad lengths: sequence ", s, " q_len ", q_len,
                ", context ", lens[s], ", blocks ", width);
    for (int64_t b = 0; b < (lens[s] + block_size - 1) / block_size; ++b) {
      const int64_t id = tables[s * width + b];
      TORCH_CHECK(id >= 0 && id < k_cache.size(0), "paged_prefill_attention_bf16: block id ",
                  id, " out of range");
    }
  }
  at::Tensor out = at::empty({tokens, heads, dim}, query.options());
#if defined(PDSERVE_PREFILL_AMX)
  // Each sequence's problem, its packed K and V at its own offsets of two shared buffers; then
  // every (sequence, kv head, span) packing, and every (sequence, head, query block), is one
  // item of one parallel region.
  std::vector<int64_t> pack_first{0}, query_first{0};  // items before each sequence
  std::vector<int64_t> k_at{0}, v_at{0};  // where each sequence's packed K and V start
  int64_t max_padded = 0;
  const int64_t k_span = 2 * (dim / kDChunk) * kRows * kRows * 2, v_span = kRows * dim * 2;
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t q_len = starts[s + 1] - starts[s], spans = (lens[s] + kSpan - 1) / kSpan;
    k_at.push_back(k_at.back() + kv_heads * spans * k_span);
    v_at.push_back(v_at.back() + kv_heads * spans * v_span);
    max_padded = std::max(max_padded, spans * kSpan);
    pack_first.push_back(pack_first.back() + kv_heads * spans);
    query_first.push_back(query_first.back() + heads * ((q_len + kRows - 1) / kRows));
  }
  at::Tensor kp = at::empty({k_at.back()}, query.options());
  at::Tensor vp = at::empty({v_at.back()}, query.options());
  std::vector<Problem> pbs;
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t q_len = starts[s + 1] - starts[s];
    pbs.push_back(Problem{bf16_data(query) + starts[s] * query.stride(0), query.stride(0),
                          mutable_bf16(kp) + k_at[s], mutable_bf16(vp) + v_at[s],
                          mutable_bf16(out) + starts[s] * heads * dim, q_len, heads, kv_heads,
                          dim, lens[s], (lens[s] + kSpan - 1) / kSpan,
                          static_cast<float>(scale)});
  }
  // The sequence an item belongs to: the last s with first[s] <= item.
  auto seq_of = [](const std::vector<int64_t>& first, int64_t item) {
    return static_cast<int64_t>(std::upper_bound(first.begin(), first.end(), item) -
                                first.begin()) - 1;
  };
  at::parallel_for(0, pack_first.back(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = seq_of(pack_first, item), local = item - pack_first[s];
      const Problem& pb = pbs[s];
      pack_span(pb, bf16_data(k_cache), bf16_data(v_cache), tables + s * width, block_size,
                local / pb.spans, local % pb.spans);
    }
  });
  at::parallel_for(0, query_first.back(), 1, [&](int64_t begin, int64_t end) {
    pdserve::configure_tiles();  // per thread: the tile state is the thread's
    Scratch sc{std::vector<float>(kRows * max_padded), std::vector<uint16_t>(kRows * max_padded),
               std::vector<uint16_t>(kRows * dim)};
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = seq_of(query_first, item), local = item - query_first[s];
      const Problem& pb = pbs[s];
      const int64_t qblocks = (pb.q_len + kRows - 1) / kRows;
      query_block(pb, local / qblocks, local % qblocks * kRows, sc);
    }
    _tile_release();
  });
#endif
  return out;
}

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("paged_prefill_attention_bf16(Tensor query, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor query_starts, Tensor context_lens, float scale) -> Tensor");
  m.def("prefill_attention_amx_built() -> bool", prefill_attention_amx_built);
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("paged_prefill_attention_bf16", paged_prefill_attention_bf16);
}
