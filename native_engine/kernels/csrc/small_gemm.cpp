// A GEMM built for decode shapes, y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M small (1..64),
// in bf16 or fp32 (x, W, bias and y all of one dtype); where it holds its own at prefill sizes
// too (AMX in bf16, AVX-512F in fp32: native_engine/kernels/small_gemm.py) it serves every M.
//
// At decode the GEMM is a read of the weights: each weight is used M times, so the time is the
// bytes of W over the memory's bandwidth. oneDNN's small-M paths move them at ~45-75 % of
// what this CPU streams (bf16 ~65-75 %, fp32 at M = 1 ~50 %); these kernels stream them at
// about all of it (benchmarks/small_gemm.py).
//
// The weights are packed once at load (pack_weight) into blocks of 16 output columns, each
// block one contiguous stream of 64-byte lines:
//   - bf16: block b, k-pair p is the line W[16b + c][2p], W[16b + c][2p + 1] for c in 0..15
//     (16 dwords, each the pair of k's of one column; K is padded with zeros to whole AMX
//     tiles, 32 k). One line is one step of a block's stream on every ISA, and 16 lines are
//     AMX's weight tile as it is: small_gemm_avx.cpp (AVX2, AVX512-BF16) and
//     small_gemm_amx.cpp read the same packing.
//   - fp32: block b, k is the line W[16b + c][k] for c in 0..15 (small_gemm_avx.cpp).
// The ISA is chosen at run time among those the build has and the CPU runs.
//
// Threads split the blocks (contiguous ranges, so each reads sequential streams), streams are
// prefetched ahead, accumulation is fp32 and a bf16 result is rounded once (to nearest even),
// as F.linear does in bf16. Every output element is one fp32 sum over k in the same order
// whatever M is and whichever rows share the call: a row's result does not depend on its
// batch (oneDNN's does; tests/engine/test_small_gemm.py checks ours).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "amx_tiles.h"
#include "cpu_ops.h"
#include "silu.h"
#include "small_gemm.h"

namespace {

using pdserve::gemm::Isa;
using pdserve::gemm::kBlockCols;
using pdserve::gemm::kTilePairs;

// Whether this build has the kernel (compiled -march=native) and this CPU runs it.
bool cpu_has(Isa isa) {
  switch (isa) {
    case Isa::kAvx2:
#if defined(__AVX2__) && defined(__FMA__)
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
      return false;
#endif
    case Isa::kAvx512Bf16:
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
      return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
#else
      return false;
#endif
    case Isa::kAvx512:
#if defined(__AVX512F__)
      return __builtin_cpu_supports("avx512f");
#else
      return false;
#endif
    case Isa::kAmx:
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
      return pdserve::amx_permitted();
#else
      return false;
#endif
    default:
      return false;
  }
}

int64_t padded_pairs(int64_t k) { return ((k + 1) / 2 + kTilePairs - 1) / kTilePairs * kTilePairs; }

const uint16_t* bf16_data(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

}  // namespace

// The kernels this build has and this CPU runs, as a bit mask of (1 << Isa).
int64_t small_gemm_isas() {
  int64_t mask = 0;
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512Bf16, Isa::kAmx, Isa::kAvx512}) {
    if (cpu_has(isa)) mask |= int64_t{1} << isa;
  }
  return mask;
}

namespace {

at::Tensor pack_bf16(const at::Tensor& weight) {
  const int64_t n = weight.size(0), k = weight.size(1), k2 = padded_pairs(k);
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::zeros({n / kBlockCols, k2, kBlockCols, 2}, weight.options());
  const uint16_t* src = bf16_data(w);
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, n / kBlockCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t c = 0; c < kBlockCols; ++c)
        for (int64_t kk = 0; kk < k; ++kk)
          dst[((b * k2 + kk / 2) * kBlockCols + c) * 2 + kk % 2] =
              src[(b * kBlockCols + c) * k + kk];
  });
  return packed;
}

at::Tensor pack_f32(const at::Tensor& weight) {
  const int64_t n = weight.size(0), k = weight.size(1);
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::empty({n / kBlockCols, k, kBlockCols}, weight.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, n / kBlockCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t c = 0; c < kBlockCols; ++c)
        for (int64_t kk = 0; kk < k; ++kk)
          dst[(b * k + kk) * kBlockCols + c] = src[(b * kBlockCols + c) * k + kk];
  });
  return packed;
}

// y = x W^T (+ bias), or with silu (silu.h's table; AMX only) silu(gate) * up of its halves.
void run_bf16(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
              int64_t k, Isa isa, at::Tensor& y, const uint16_t* silu = nullptr) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kBlockCols && packed.size(3) == 2 &&
                  packed.size(1) == padded_pairs(k),
              "small_gemm: a bf16 packed weight must come from pack_weight");
  const int64_t m = x.size(0), n = packed.size(0) * kBlockCols;
  const pdserve::gemm::Problem pb{
      bf16_data(x),
      x.stride(0),
      reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>()),
      packed.size(1),
      (k + 1) / 2,
      k,
      bias.has_value() ? bf16_data(*bias) : nullptr,
      reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()),
      n,
      m,
      silu,
  };
  switch (isa) {
    case Isa::kAmx: pdserve::gemm::gemm_amx(pb); break;
    case Isa::kAvx512Bf16: pdserve::gemm::gemm_avx512bf16(pb); break;
    case Isa::kAvx2: pdserve::gemm::gemm_avx2(pb); break;
    default: TORCH_CHECK(false, "small_gemm: isa ", int64_t{isa}, " has no bf16 kernel");
  }
}

void run_f32(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
             int64_t k, Isa isa, at::Tensor& y) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == k && packed.size(2) == kBlockCols,
              "small_gemm: an fp32 packed weight must come from pack_weight");
  const pdserve::gemm::ProblemF32 pb{
      x.data_ptr<float>(), x.stride(0), packed.data_ptr<float>(), k,
      bias.has_value() ? bias->data_ptr<float>() : nullptr,
      y.data_ptr<float>(), y.size(1), x.size(0),
  };
  switch (isa) {
    case Isa::kAvx512: pdserve::gemm::gemm_f32_avx512(pb); break;
    case Isa::kAvx2: pdserve::gemm::gemm_f32_avx2(pb); break;
    default: TORCH_CHECK(false, "small_gemm: isa ", int64_t{isa}, " has no fp32 kernel");
  }
}

bool gemm_dtype(at::ScalarType t) { return t == at::kBFloat16 || t == at::kFloat; }

}  // namespace

at::Tensor pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && gemm_dtype(weight.scalar_type()),
              "pack_weight: a 2-D bf16 or fp32 weight [N, K]");
  TORCH_CHECK(weight.size(0) % kBlockCols == 0, "pack_weight: N must be a multiple of 16, got ",
              weight.size(0));
  return weight.scalar_type() == at::kFloat ? pack_f32(weight) : pack_bf16(weight);
}

namespace {

// Checks a GEMM's operands (`op` names it in a refusal); returns N.
int64_t checked_n(const at::Tensor& x, const at::Tensor& packed,
                  const c10::optional<at::Tensor>& bias, int64_t k, int64_t isa, const char* op) {
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && gemm_dtype(dtype) && x.stride(1) == 1, op,
              ": x must be [M, K] bf16 or fp32 with unit column stride");
  TORCH_CHECK(packed.scalar_type() == dtype && packed.is_contiguous(), op,
              ": packed must come from pack_weight, in x's dtype");
  TORCH_CHECK(x.size(1) == k, op, ": x has K=", x.size(1), ", the weight K=", k);
  const int64_t n = packed.size(0) * kBlockCols;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->numel() == n && bias->is_contiguous(), op,
                ": bias must be [N] in x's dtype");
  }
  TORCH_CHECK(cpu_has(static_cast<Isa>(isa)), op, ": isa ", isa, " is not available here");
  return n;
}

}  // namespace

at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& packed,
                      const c10::optional<at::Tensor>& bias, int64_t k, int64_t isa) {
  const int64_t n = checked_n(x, packed, bias, k, isa, "small_gemm");
  at::Tensor y = pdserve::empty_cpu({x.size(0), n}, x);
  if (x.size(0) == 0) return y;
  if (x.scalar_type() == at::kFloat) {
    run_f32(x, packed, bias, k, static_cast<Isa>(isa), y);
  } else {
    run_bf16(x, packed, bias, k, static_cast<Isa>(isa), y);
  }
  return y;
}

// silu_mul(small_gemm(...)) bit for bit: the MLP's gate_up projection (gate | up) and its
// activation. AMX takes both in one pass where each half is whole blocks (small_gemm_amx.cpp:
// the [M, N] product is never written); elsewhere it is the two ops.
at::Tensor small_gemm_silu_mul(const at::Tensor& x, const at::Tensor& packed,
                               const c10::optional<at::Tensor>& bias, int64_t k, int64_t isa) {
  const int64_t n = checked_n(x, packed, bias, k, isa, "small_gemm_silu_mul");
  TORCH_CHECK(n % 2 == 0, "small_gemm_silu_mul: N must be even (gate | up), got ", n);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if (x.scalar_type() == at::kBFloat16 && isa == Isa::kAmx && n / 2 % kBlockCols == 0) {
    at::Tensor y = pdserve::empty_cpu({x.size(0), n / 2}, x);
    if (x.size(0) > 0) run_bf16(x, packed, bias, k, Isa::kAmx, y, pdserve::silu_table());
    return y;
  }
#endif
  return silu_mul(small_gemm(x, packed, bias, k, isa));
}

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("pack_weight(Tensor weight) -> Tensor");
  m.def("small_gemm(Tensor x, Tensor packed, Tensor? bias, int k, int isa) -> Tensor");
  m.def("small_gemm_silu_mul(Tensor x, Tensor packed, Tensor? bias, int k, int isa) -> Tensor");
  m.def("small_gemm_isas() -> int", small_gemm_isas);  // no tensor: one kernel for all keys
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("pack_weight", pack_weight);
  m.impl("small_gemm", small_gemm);
  m.impl("small_gemm_silu_mul", small_gemm_silu_mul);
}
