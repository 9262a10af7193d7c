// A bf16 GEMM for decode shapes, y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M small (1..64).
//
// At decode the GEMM is a read of the weights: each weight is used M times, so the time is the
// bytes of W over the memory's bandwidth. oneDNN's small-M bf16 path moves them at ~65-75 % of
// what this CPU streams; these kernels stream them at about all of it (benchmarks/small_gemm.py).
//
// The weights are packed once at load (pack_bf16_weight) into blocks of 16 output columns,
// each block one contiguous stream: block b, k-pair p is the 64-byte line
//   W[16b + c][2p], W[16b + c][2p + 1]   for c in 0..15
// (16 dwords, each the pair of k's of one column; K is padded with zeros to whole AMX tiles,
// 32 k). One line is one step of a block's stream on every ISA, and 16 lines are AMX's weight
// tile as it is: small_gemm_avx.cpp (AVX2, AVX512-BF16) and small_gemm_amx.cpp read the same
// packing. The ISA is chosen at run time among those the build has and the CPU runs.
//
// Threads split the blocks (contiguous ranges, so each reads sequential streams), streams are
// prefetched ahead, accumulation is fp32 and the result is rounded once to bf16 (to nearest
// even), as F.linear does in bf16. Every output element is one fp32 sum over k in the same
// order whatever M is and whichever rows share the call: a row's result does not depend on
// its batch (oneDNN's does; tests/engine/test_small_gemm.py checks ours).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "amx_tiles.h"
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
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512Bf16, Isa::kAmx}) {
    if (cpu_has(isa)) mask |= int64_t{1} << isa;
  }
  return mask;
}

at::Tensor pack_bf16_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "pack_bf16_weight: a 2-D bf16 weight [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1), k2 = padded_pairs(k);
  TORCH_CHECK(n % kBlockCols == 0, "pack_bf16_weight: N must be a multiple of 16, got ", n);
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::zeros({n / kBlockCols, k2, kBlockCols, 2}, weight.options());
  const uint16_t* src = bf16_data(w);
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, n / kBlockCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t c = 0; c < kBlockCols; ++c)
        for (int64_t kk = 0; kk < k; ++kk)
          dst[((b * k2 + kk / 2) * kBlockCols + c) * 2 + kk % 2] = src[(b * kBlockCols + c) * k + kk];
  });
  return packed;
}

at::Tensor small_gemm_bf16(const at::Tensor& x, const at::Tensor& packed,
                           const c10::optional<at::Tensor>& bias, int64_t k, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "small_gemm_bf16: x must be [M, K] bf16 with unit column stride");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 &&
                  packed.size(2) == kBlockCols && packed.size(3) == 2 && packed.is_contiguous(),
              "small_gemm_bf16: packed must come from pack_bf16_weight");
  TORCH_CHECK(x.size(1) == k && packed.size(1) == padded_pairs(k), "small_gemm_bf16: x has K=",
              x.size(1), ", the weight K=", k);
  const int64_t m = x.size(0), n = packed.size(0) * kBlockCols;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == n && bias->is_contiguous(),
                "small_gemm_bf16: bias must be [N] bf16");
  }
  const auto chosen = static_cast<Isa>(isa);
  TORCH_CHECK(cpu_has(chosen), "small_gemm_bf16: isa ", isa, " is not available here");
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
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
  };
  switch (chosen) {
    case Isa::kAmx: pdserve::gemm::gemm_amx(pb); break;
    case Isa::kAvx512Bf16: pdserve::gemm::gemm_avx512bf16(pb); break;
    default: pdserve::gemm::gemm_avx2(pb); break;
  }
  return y;
}

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("pack_bf16_weight(Tensor weight) -> Tensor");
  m.def("small_gemm_bf16(Tensor x, Tensor packed, Tensor? bias, int k, int isa) -> Tensor");
  m.def("small_gemm_isas() -> int", small_gemm_isas);  // no tensor: one kernel for all keys
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("pack_bf16_weight", pack_bf16_weight);
  m.impl("small_gemm_bf16", small_gemm_bf16);
}
