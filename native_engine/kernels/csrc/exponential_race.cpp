// The sampler's exponential race for rows without a seed of their own: token =
// argmax_j p_j / q_j with q_j ~ Exp(1) i.i.d., which draws from p exactly
// (engine/sampling.py). torch's exponential_ fills q one element at a time on one thread
// (~15 ns each: 15 ms of a batch-20 step over a 49K vocabulary); here q_j = -log(u_j) with
// u_j from a counter-based generator, SplitMix64 of (row seed, j), so rows run in parallel
// and each row's draw depends on its seed alone (vLLM's CPU sampler draws the same way).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
#endif

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

inline uint64_t splitmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// u in (0, 1): the top 23 bits and a half, exact in fp32, so u <= 1 - 2^-24 and log(u) < 0
// (with 24 bits, 2^24 - 0.5 rounds to 2^24: u = 1, q = 0, and that token would always win).
inline float uniform(uint64_t bits) {
  return (static_cast<float>(bits >> 41) + 0.5f) * (1.0f / 8388608.0f);
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
inline __m512i splitmix64x8(__m512i z) {
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)),
                         _mm512_set1_epi64(static_cast<int64_t>(0xBF58476D1CE4E5B9ull)));
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)),
                         _mm512_set1_epi64(static_cast<int64_t>(0x94D049BB133111EBull)));
  return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
}

// 16 uniforms for counters j0 .. j0 + 15 of a row.
inline __m512 uniform16(uint64_t seed, int64_t j0) {
  const __m512i lanes = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i top[2];
  for (int h = 0; h < 2; ++h) {
    const __m512i j = _mm512_add_epi64(lanes, _mm512_set1_epi64(j0 + 8 * h));
    const __m512i z = _mm512_add_epi64(_mm512_set1_epi64(static_cast<int64_t>(seed)),
                                       _mm512_mullo_epi64(j, _mm512_set1_epi64(static_cast<int64_t>(kGolden))));
    top[h] = _mm512_cvtepi64_epi32(_mm512_srli_epi64(splitmix64x8(z), 41));
  }
  const __m512i bits = _mm512_inserti64x4(_mm512_castsi256_si512(top[0]), top[1], 1);
  return _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(bits), _mm512_set1_ps(0.5f)),
                       _mm512_set1_ps(1.0f / 8388608.0f));
}

// log(x) for x in (0, 1]: x = m 2^e with m in [sqrt(1/2), sqrt(2)), log m by the series of
// atanh (s = (m - 1) / (m + 1)) to s^9: within a few ulp, and a race needs no more.
inline __m512 log16(__m512 x) {
  __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);  // [1, 2)
  __m512 e = _mm512_getexp_ps(x);
  const __mmask16 big = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356f), _CMP_GT_OQ);
  m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5f));
  e = _mm512_mask_add_ps(e, big, e, _mm512_set1_ps(1.0f));
  const __m512 s = _mm512_div_ps(_mm512_sub_ps(m, _mm512_set1_ps(1.0f)),
                                 _mm512_add_ps(m, _mm512_set1_ps(1.0f)));
  const __m512 s2 = _mm512_mul_ps(s, s);
  __m512 p = _mm512_set1_ps(2.0f / 9);
  p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(2.0f / 7));
  p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(2.0f / 5));
  p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(2.0f / 3));
  p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(2.0f));
  return _mm512_fmadd_ps(e, _mm512_set1_ps(0.693147180559945f), _mm512_mul_ps(p, s));
}
#endif

// The winner of one row: the first index of the largest p_j / q_j (ties: the first).
int64_t race_row(const float* p, int64_t n, uint64_t seed) {
  float best = -1.0f;
  int64_t best_j = 0;
  int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  __m512 best_v = _mm512_set1_ps(-1.0f);
  __m512i best_i = _mm512_set1_epi32(0);
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; j + 16 <= n; j += 16) {
    const __m512 q = _mm512_sub_ps(_mm512_setzero_ps(), log16(uniform16(seed, j)));
    const __m512 score = _mm512_div_ps(_mm512_loadu_ps(p + j), q);
    const __mmask16 better = _mm512_cmp_ps_mask(score, best_v, _CMP_GT_OQ);
    best_v = _mm512_mask_mov_ps(best_v, better, score);
    best_i = _mm512_mask_mov_epi32(best_i, better,
                                   _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(j))));
  }
  alignas(64) float v[16];
  alignas(64) int32_t idx[16];
  _mm512_store_ps(v, best_v);
  _mm512_store_si512(idx, best_i);
  for (int l = 0; l < 16; ++l)
    if (v[l] > best || (v[l] == best && idx[l] < best_j)) best = v[l], best_j = idx[l];
#endif
  for (; j < n; ++j) {
    const uint64_t z = seed + static_cast<uint64_t>(j) * kGolden;
    const float score = p[j] / -std::log(uniform(splitmix64(z)));
    if (score > best) best = score, best_j = j;
  }
  return best_j;
}

}  // namespace

// ids[r] = argmax_j probs[r, j] / q_j, q from seeds[r]. probs: [rows, vocab] fp32 (zero where a
// filter removed a token: those never win).
at::Tensor exponential_race(const at::Tensor& probs, const at::Tensor& seeds) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat && probs.stride(1) == 1 &&
                  probs.size(1) > 0,
              "exponential_race: probs must be [rows, vocab > 0] float32 with unit column stride");
  TORCH_CHECK(seeds.dim() == 1 && seeds.scalar_type() == at::kLong && seeds.is_contiguous() &&
                  seeds.size(0) == probs.size(0),
              "exponential_race: seeds must be [rows] int64");
  const int64_t rows = probs.size(0), n = probs.size(1), ld = probs.stride(0);
  at::Tensor out = at::empty({rows}, seeds.options());
  const float* pp = probs.data_ptr<float>();
  const int64_t* ps = seeds.data_ptr<int64_t>();
  int64_t* po = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) po[r] = race_row(pp + r * ld, n, static_cast<uint64_t>(ps[r]));
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("exponential_race(Tensor probs, Tensor seeds) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("exponential_race", exponential_race); }
