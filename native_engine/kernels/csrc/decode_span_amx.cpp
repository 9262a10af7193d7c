// The decode span (decode_span.h) for a bf16 cache on AMX: keys and values are read where they
// lie, as tiles, with no copy or repacking of the cache.
//
// Why: on the AVX-512 span the dot products themselves were the cost. Each token's row went
// through ~100 vector instructions (vdpbf16ps, the transposing sums, widening the values, fp32
// FMAs), and a batch-32 step's attention spent more time computing than reading. Here the
// products are tile ops. The vector work left is the softmax and a transpose, ~20 instructions
// a token.
//
// The arithmetic, per span (one sequence's tokens [t0, t1), every head):
//   - Scores, 16 tokens at a time: C[token][query head] = sum over the token row's 32-dim
//     chunks of K-chunk (16 rows read in place, one row per token) x Q-chunk. Q is packed once
//     per span as a block-diagonal operand: chunk j of a token row belongs to kv head j / C,
//     and only that kv head's query heads have non-zero columns. So one tile holds every head
//     of 16 tokens (up to 16 query heads), grouped-query attention included.
//   - The tile is transposed to head-major rows, scaled, masked past the span's end. Each
//     head's max, exp (vec_exp.h) and sum are in fp32, lane-wise in token order. The part gets
//     [max, sum], as the AVX-512 span's.
//   - Values, 16 tokens at a time: AMX's second operand wants pairs along the reduced
//     dimension. V's rows as they lie are pairs of dims. So A's row 2g holds head g's
//     probabilities as (p, 0) pairs and row 2g + 1 as (0, p): C's row 2g then sums p v[even
//     dims] and row 2g + 1 p v[odd dims], with V read in place. Each probability is split into
//     two bf16 (hi + lo, rows 8.. take lo): about 16 bits of p (relative error <= 2^-16), where
//     one bf16 rounding of it (2^-9) made the output's mean error 1.4x the AVX-512 span's;
//     with the pair it is the same. Every product of two bf16 is exact in fp32; sums are
//     fp32.
//   - Rows past the span's end inside its last block may hold anything (a stale slot, NaN).
//     Their scores are masked to weigh exactly 0. Their value rows are replaced by zeros
//     before the product, since 0 x NaN is NaN.
//
// Memory: a batch's cache rows are cold, scattered in 12 KB blocks. The next span this thread
// takes has its rows fetched into L2 while this one computes, a few lines between each pair
// of tile ops (fetched in bursts, the loads waited behind the prefetches).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "decode_span.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PDSERVE_DECODE_AMX 1
#include <immintrin.h>
#endif

namespace pdserve {

namespace {

constexpr int64_t kMaxSpan = kAmxSpanTokens;  // tokens of a span (and of the next)
constexpr int64_t kMaxHeads = 16;  // query heads: one score tile's columns

}  // namespace

bool decode_span_amx_supported(int64_t block_size, int64_t head_dim, int64_t num_q_heads) {
#if defined(PDSERVE_DECODE_AMX)
  return amx_permitted() && block_size % 16 == 0 && block_size <= kMaxSpan &&
         (head_dim == 64 || head_dim == 128) && num_q_heads <= kMaxHeads;
#else
  (void)block_size, (void)head_dim, (void)num_q_heads;
  return false;
#endif
}

#if defined(PDSERVE_DECODE_AMX)
namespace {

constexpr float kMasked = -1e30f;  // finite: the build is -ffast-math

// Thread-local scratch on whole 64-byte lines (a vector store or tile load never splits one),
// zeroed when it grows.
struct Scratch {
  std::vector<__m512i> lines;
  template <typename T>
  T* get(size_t bytes) {
    if (lines.size() < (bytes + 63) / 64) lines.assign((bytes + 63) / 64, _mm512_setzero_si512());
    return reinterpret_cast<T*>(lines.data());
  }
};

// The next span's cache lines, K and V interleaved, handed to the prefetcher a few at a time:
// `pump` is called between tile ops, `per` lines each, so the fetch runs beside the compute.
class NextSpanFetch {
 public:
  NextSpanFetch(const DecodeSpan& s, int64_t row_bytes, int64_t pumps)
      : k_(static_cast<const char*>(s.k)), v_(static_cast<const char*>(s.v)),
        lines_per_row_(row_bytes / 64) {
    rows_ = s.next_table != nullptr ? s.next_t1 - s.next_t0 : 0;
    if (rows_ > 0)
      row_offsets(s.next_table, s.block_size, s.num_kv_heads * s.head_dim, s.next_t0, rows_,
                  offsets_);
    per_ = (rows_ * lines_per_row_ + pumps - 1) / std::max<int64_t>(pumps, 1);  // K, V pairs
  }
  void pump() {
    for (int64_t i = 0; i < per_ && row_ < rows_; ++i) {
      const int64_t at = offsets_[row_] * 2 + 64 * line_;
      _mm_prefetch(k_ + at, _MM_HINT_T1);
      _mm_prefetch(v_ + at, _MM_HINT_T1);
      if (++line_ == lines_per_row_) {
        line_ = 0;
        ++row_;
      }
    }
  }
  void finish() {
    while (row_ < rows_) pump();
  }

 private:
  const char* k_;
  const char* v_;
  int64_t lines_per_row_, rows_, per_ = 1, row_ = 0, line_ = 0;
  int64_t offsets_[kMaxSpan];
};

// 16 rows of 16 floats (row stride ld) into out[column][row].
inline void transpose16(const float* in, int64_t ld, float* out) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(in + i * ld);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + j], 128-bit lane L: column 4L + j of rows 4i..4i+3
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int j = 0; j < 4; ++j) {
    const __m512 a = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
    const __m512 b = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
    const __m512 c = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xDD);
    const __m512 d = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xDD);
    t[j] = _mm512_shuffle_f32x4(a, b, 0x88);
    t[8 + j] = _mm512_shuffle_f32x4(a, b, 0xDD);
    t[4 + j] = _mm512_shuffle_f32x4(c, d, 0x88);
    t[12 + j] = _mm512_shuffle_f32x4(c, d, 0xDD);
  }
  for (int i = 0; i < 16; ++i) _mm512_store_ps(out + 16 * i, t[i]);
}

// The query as the scores' second operand: per 32-dim chunk j of a token row,
// [16 dim pairs][16 query heads][2], zero in the columns of other kv heads' query heads.
void pack_query(const DecodeSpan& s, int64_t chunks, uint16_t* qp) {
  const int64_t dim_chunks = s.head_dim / 32, heads = s.num_kv_heads * s.group;
  std::memset(qp, 0, chunks * 1024);
  const __m512i rows = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(16));
  for (int64_t qh = 0; qh < heads; ++qh)
    for (int64_t c = 0; c < dim_chunks; ++c) {
      const float* src = s.q + qh * s.head_dim + 32 * c;
      // dword r = dims 2r, 2r + 1 (the query is bf16 widened: narrowing it back is exact)
      const __m512i pairs =
          (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
      const int64_t j = (qh / s.group) * dim_chunks + c;
      _mm512_i32scatter_epi32(reinterpret_cast<int*>(qp + j * 512) + qh, rows, pairs, 4);
    }
}

template <int D>
void run(const DecodeSpan& s) {
  constexpr int C = D / 32;  // 32-dim chunks of a head: C accumulator tiles for the values
  const int64_t kv = s.num_kv_heads, group = s.group, heads = kv * group;
  const int64_t n = s.t1 - s.t0, n16 = (n + 15) / 16 * 16, tiles = n16 / 16;
  const int64_t chunks = kv * C, token_stride = kv * D, ld = token_stride * 2;
  const auto* k = static_cast<const uint16_t*>(s.k);
  const auto* v = static_cast<const uint16_t*>(s.v);
  thread_local Scratch qpack_s, score_s, prob_s, a_s, tail_s, out_s;
  auto* qp = qpack_s.get<uint16_t>(chunks * 1024);
  auto* score = score_s.get<float>(16 * 16 * 4);
  auto* prob = prob_s.get<uint16_t>(2 * kMaxHeads * kMaxSpan * 2);  // hi, then lo
  uint16_t* const prob_lo = prob + kMaxHeads * kMaxSpan;
  auto* a_tile = a_s.get<uint32_t>(16 * 64);  // rows past 4 heads' hi and lo stay unread
  auto* tail = tail_s.get<uint16_t>(16 * C * 64);
  auto* o = out_s.get<float>(C * 1024);
  int64_t off[kMaxSpan];
  row_offsets(s.table, s.block_size, token_stride, s.t0, n, off);
  const int64_t row_bytes = token_stride * 2;
  // A thread's first span was not fetched by a span before it: fetch it now.
  if (!s.prefetched)
    for (int64_t t = 0; t < n; ++t)
      for (int64_t j = 0; j < row_bytes; j += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(k + off[t]) + j, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(v + off[t]) + j, _MM_HINT_T1);
      }
  NextSpanFetch next(s, row_bytes, tiles * chunks + heads + kv * tiles * 2);  // its pump calls
  if (s.new_query) pack_query(s, chunks, qp);
  configure_tiles();

  // Scores, head-major, scaled and masked: rows[qh][t].
  alignas(64) float rows[kMaxHeads][kMaxSpan];
  alignas(64) float transposed[16 * 16];
  const __m512 scale = _mm512_set1_ps(s.scale), masked = _mm512_set1_ps(kMasked);
  for (int64_t tt = 0; tt < n; tt += 16) {
    _tile_zero(0);
    const uint16_t* kr = k + off[tt];
    for (int64_t j = 0; j < chunks; ++j) {
      next.pump();
      if (j % 2 == 0) {  // two operand pairs in turn: a load overlaps the previous product
        _tile_loadd(2, kr + 32 * j, ld);
        _tile_loadd(4, qp + j * 512, 64);
        _tile_dpbf16ps(0, 2, 4);
      } else {
        _tile_loadd(3, kr + 32 * j, ld);
        _tile_loadd(5, qp + j * 512, 64);
        _tile_dpbf16ps(0, 3, 5);
      }
    }
    _tile_stored(0, score, 64);
    transpose16(score, 16, transposed);
    const __mmask16 live = n - tt >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - tt)) - 1);
    for (int64_t qh = 0; qh < heads; ++qh) {
      const __m512 raw = _mm512_load_ps(transposed + 16 * qh);
      _mm512_store_ps(rows[qh] + tt, _mm512_mask_mul_ps(masked, live, raw, scale));
    }
  }

  // Softmax per head: max, exp, fp32 sum in token order; probabilities as bf16 hi + lo.
  for (int64_t qh = 0; qh < heads; ++qh) {
    next.pump();
    __m512 mv = masked;
    for (int64_t tt = 0; tt < n16; tt += 16) mv = _mm512_max_ps(mv, _mm512_load_ps(rows[qh] + tt));
    const float max_score = _mm512_reduce_max_ps(mv);
    const __m512 m = _mm512_set1_ps(max_score);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t tt = 0; tt < n16; tt += 16) {
      const __m512 x = _mm512_load_ps(rows[qh] + tt);
      const __m512 p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, masked, _CMP_GT_OQ),
                                           exp_nonpositive(_mm512_sub_ps(x, m)));
      sum = _mm512_add_ps(sum, p);
      const __m256i hi = (__m256i)_mm512_cvtneps_pbh(p);
      const __m512 hi_f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
      _mm256_store_si256(reinterpret_cast<__m256i*>(prob + qh * kMaxSpan + tt), hi);
      _mm256_store_si256(reinterpret_cast<__m256i*>(prob_lo + qh * kMaxSpan + tt),
                         (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(p, hi_f)));
    }
    float* part = s.part + qh * (D + 2);
    part[0] = max_score;
    part[1] = _mm512_reduce_add_ps(sum);
  }

  // Values, up to 4 query heads of one kv head at a time (hi in A's rows 0..7, lo in 8..15).
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int64_t h = 0; h < kv; ++h)
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
      const int64_t gn = std::min<int64_t>(4, group - g0);
      _tile_zero(0);
      _tile_zero(1);
      if constexpr (C > 2) {
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int64_t tt = 0; tt < n; tt += 16) {
        if (g0 == 0) next.pump();
        for (int64_t g = 0; g < gn; ++g) {
          const int64_t qh = h * group + g0 + g;
          const __m512i hi = _mm512_cvtepu16_epi32(
              _mm256_load_si256(reinterpret_cast<const __m256i*>(prob + qh * kMaxSpan + tt)));
          const __m512i lo = _mm512_cvtepu16_epi32(
              _mm256_load_si256(reinterpret_cast<const __m256i*>(prob_lo + qh * kMaxSpan + tt)));
          _mm512_store_si512(a_tile + 32 * g, hi);  // (p, 0)
          _mm512_store_si512(a_tile + 32 * g + 16, _mm512_slli_epi32(hi, 16));  // (0, p)
          _mm512_store_si512(a_tile + 128 + 32 * g, lo);
          _mm512_store_si512(a_tile + 128 + 32 * g + 16, _mm512_slli_epi32(lo, 16));
        }
        if constexpr (C == 2) {  // A after the accumulators: tile 3, or 5 at head_dim 128
          _tile_loadd(3, a_tile, 64);
        } else {
          _tile_loadd(5, a_tile, 64);
        }
        const uint16_t* vr = v + off[tt] + h * D;
        int64_t ldv = ld;
        if (n - tt < 16) {  // rows past the span's end: zeros
          std::memset(tail, 0, 16 * C * 64);
          for (int64_t i = 0; i < n - tt; ++i)
            std::memcpy(tail + i * 32 * C, v + off[tt + i] + h * D, 64 * C);
          vr = tail;
          ldv = 64 * C;
        }
        if (g0 == 0) next.pump();
        if constexpr (C == 2) {
          _tile_loadd(4, vr, ldv);
          _tile_dpbf16ps(0, 3, 4);
          _tile_loadd(5, vr + 32, ldv);
          _tile_dpbf16ps(1, 3, 5);
        } else {
          _tile_loadd(6, vr, ldv);
          _tile_dpbf16ps(0, 5, 6);
          _tile_loadd(7, vr + 32, ldv);
          _tile_dpbf16ps(1, 5, 7);
          _tile_loadd(6, vr + 64, ldv);
          _tile_dpbf16ps(2, 5, 6);
          _tile_loadd(7, vr + 96, ldv);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, o, 64);
      _tile_stored(1, o + 256, 64);
      if constexpr (C > 2) {
        _tile_stored(2, o + 512, 64);
        _tile_stored(3, o + 768, 64);
      }
      // Row 2g: even dims, 2g + 1: odd dims, each hi (rows 0..7) plus lo (rows 8..15).
      for (int64_t g = 0; g < gn; ++g) {
        float* out = s.part + (h * group + g0 + g) * (D + 2) + 2;
        for (int c = 0; c < C; ++c) {
          const float* r = o + 256 * c + 32 * g;
          const __m512 even = _mm512_add_ps(_mm512_load_ps(r), _mm512_load_ps(r + 128));
          const __m512 odd = _mm512_add_ps(_mm512_load_ps(r + 16), _mm512_load_ps(r + 144));
          _mm512_storeu_ps(out + 32 * c, _mm512_permutex2var_ps(even, first, odd));
          _mm512_storeu_ps(out + 32 * c + 16, _mm512_permutex2var_ps(even, second, odd));
        }
      }
    }
  next.finish();
  _tile_release();
}

}  // namespace

void decode_span_amx(const DecodeSpan& span) {
  if (span.head_dim == 64) {
    run<64>(span);
  } else {
    run<128>(span);
  }
}

#else

void decode_span_amx(const DecodeSpan&) {}

#endif

}  // namespace pdserve
