"""pdserve's small-M GEMM (native_engine/kernels/csrc/small_gemm.cpp) on every kernel this CPU
runs for bf16 and for fp32, every shape class (one block, a ragged tile, many tiles split
unevenly over threads; K odd, under a tile, not a tile multiple; M of decode and of prefill,
on both sides of AMX's switch from streaming to panels) and both thread counts: against an
fp64 reference within one rounding of the dtype plus the fp32 sum's error bound, against
``F.linear`` (the path it replaces; in bf16 to the bit in all but a few elements), and the
same bits for a row whatever M, whatever the thread count."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from native_engine.kernels import fused_ops, small_gemm
from native_engine.kernels.small_gemm import GemmIsa
from native_engine.models.linear import Linear

DTYPES = [torch.bfloat16, torch.float32]
ISAS = small_gemm.available(torch.bfloat16)
# Every (dtype, kernel) this CPU runs.
CASES = [(dtype, isa) for dtype in DTYPES for isa in small_gemm.available(dtype)]
CASE_IDS = [f"{str(d).removeprefix('torch.')}-{i.name}" for d, i in CASES]
SHAPES = [(16, 64), (48, 33), (960, 576), (208, 1000), (576, 1536)]  # (N, K)
ROWS = [1, 3, 16, 17, 40, 48, 49, 64, 100, 300]  # AMX: panels above 16


def test_this_x86_cpu_runs_at_least_the_avx2_kernels() -> None:
    for dtype in DTYPES:
        isas = small_gemm.available(dtype)
        assert GemmIsa.AVX2 in isas, f"{dtype} kernels here: {isas}"
        assert small_gemm.chosen(dtype) == isas[-1]
    assert small_gemm.chosen(torch.float16) is None


@pytest.fixture(params=[1, 2], ids=lambda n: f"threads{n}")
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def operands(
    n: int, k: int, m: int, seed: int, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    # Columns of different scales: the fp32 sum's rounding matters.
    w = (torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 0.2).to(dtype)
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    return w, x, bias


def bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """One rounding of the result to its dtype (bf16: u = 2^-8; fp32: 2^-24) plus the fp32
    sum's worst case over K terms and the bias."""
    k = x.shape[1]
    magnitude = x.double().abs() @ w.double().abs().T + bias.double().abs()
    unit = 2.0**-8 if x.dtype == torch.bfloat16 else 2.0**-24
    return ref.abs() * unit + (k + 2) * 2.0**-24 * magnitude


@pytest.mark.parametrize(("dtype", "isa"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize(("n", "k"), SHAPES, ids=lambda s: str(s))
def test_the_kernel_is_within_one_rounding_of_fp64_and_is_f_linear_but_rarely(
    dtype: torch.dtype, isa: GemmIsa, n: int, k: int, threads: int
) -> None:
    w, x, bias = operands(n, k, max(ROWS), seed=n * k, dtype=dtype)
    packed = small_gemm.pack(w)
    ref = x.double() @ w.double().T + bias.double()
    expected = F.linear(x, w, bias)
    for m in ROWS:
        got = small_gemm.gemm(x[:m], packed, bias, k, isa)
        assert got.dtype == dtype and got.shape == (m, n)
        err = (got.double() - ref[:m]).abs()
        assert bool((err <= bound(x[:m], w, bias, ref[:m])).all()), f"M={m}: max {err.max()}"
        differ = got != expected[:m]
        if dtype == torch.bfloat16:  # fp32 results differ in their last bits as sums do
            assert differ.float().mean().item() <= 2e-3, f"M={m}: {int(differ.sum())} differ"
        # Where they differ, both are within the bound of the exact value: two fp32 sums in
        # other orders that round apart (a relative step would not hold near a cancellation).
        apart = (got.double() - expected[:m].double()).abs()
        assert bool((apart <= 2 * bound(x[:m], w, bias, ref[:m]))[differ].all())


@pytest.mark.parametrize(("dtype", "isa"), CASES, ids=CASE_IDS)
def test_a_row_is_the_same_bits_whatever_m_and_thread_count(
    dtype: torch.dtype, isa: GemmIsa
) -> None:
    # 61 blocks: threads' ranges that are not whole tiles of blocks (fp32 takes 3 or 4)
    n, k = 976, 576
    w, x, bias = operands(n, k, 300, seed=7, dtype=dtype)
    packed = small_gemm.pack(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = small_gemm.gemm(x, packed, bias, k, isa)
        torch.set_num_threads(1)
        assert torch.equal(small_gemm.gemm(x, packed, bias, k, isa), full)
    finally:
        torch.set_num_threads(before)
    for m in (1, 2, 4, 5, 8, 16, 17, 33, 48, 49, 64, 81, 129, 250):
        assert torch.equal(small_gemm.gemm(x[:m], packed, bias, k, isa), full[:m]), m
    # A row alone, from anywhere in the batch, and a batch from anywhere.
    assert torch.equal(small_gemm.gemm(x[37:38], packed, bias, k, isa), full[37:38])
    assert torch.equal(small_gemm.gemm(x[37:137], packed, bias, k, isa), full[37:137])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize(("dtype", "isa"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize(("n", "k"), [(3072, 576), (96, 64), (64, 40), (80, 33)], ids=str)
def test_gemm_silu_mul_is_the_two_ops_bit_for_bit(
    dtype: torch.dtype, isa: GemmIsa, n: int, k: int, threads: int
) -> None:
    """The gated MLP's projection and activation in one call (fused on AMX where each half is
    whole blocks: 3072, 96 and 64 here; 80's halves are not, and take the two ops) against
    silu_mul of the GEMM, streaming and panel sizes, with a bias and without, gates wide
    enough that SiLU's whole range is hit."""
    w, x, bias = operands(n, k, 300, seed=13, dtype=dtype)
    x = x * 4
    packed = small_gemm.pack(w)
    for m in (1, 5, 16, 17, 33, 64, 129, 300):
        for b in (None, bias):
            fused = small_gemm.gemm_silu_mul(x[:m], packed, b, k, isa)
            ref = fused_ops.silu_mul(small_gemm.gemm(x[:m], packed, b, k, isa))
            assert fused.shape == (m, n // 2)
            assert torch.equal(bits(fused), bits(ref)), (m, b is None)
    empty = small_gemm.gemm_silu_mul(x[:0], packed, None, k, isa)
    assert empty.shape == (0, n // 2)


def test_the_fp32_kernels_are_the_same_bits() -> None:
    """AVX2 and AVX-512F take each element's sum in the same order (one FMA chain over k)."""
    isas = small_gemm.available(torch.float32)
    w, x, bias = operands(208, 1000, 40, seed=5, dtype=torch.float32)
    packed = small_gemm.pack(w)
    results = [small_gemm.gemm(x, packed, bias, 1000, isa) for isa in isas]
    assert len(results) >= 1
    assert all(torch.equal(r, results[0]) for r in results)


@pytest.mark.parametrize(("dtype", "isa"), CASES, ids=CASE_IDS)
def test_strided_rows_and_what_lies_past_k_never_reach_the_result(
    dtype: torch.dtype, isa: GemmIsa
) -> None:
    """x as a view into wider rows whose tail is NaN: K padded to a tile must read zeros."""
    n, k = 48, 40
    w, x, _ = operands(n, k, 5, seed=3, dtype=dtype)
    wide = torch.full((5, 96), float("nan"), dtype=dtype)
    wide[:, :k] = x
    got = small_gemm.gemm(wide[:, :k], small_gemm.pack(w), None, k, isa)
    assert bool(torch.isfinite(got).all())
    assert torch.equal(got, small_gemm.gemm(x, small_gemm.pack(w), None, k, isa))


def test_bad_operands_are_refused_by_name() -> None:
    w, x, _ = operands(32, 64, 2, seed=1)
    packed = small_gemm.pack(w)
    isa = ISAS[0]
    with pytest.raises(RuntimeError, match="N must be a multiple of 16"):
        small_gemm.pack(w[:30])
    with pytest.raises(RuntimeError, match="K=63"):
        small_gemm.gemm(x[:, :63], packed, None, 64, isa)
    with pytest.raises(RuntimeError, match="in x's dtype"):
        small_gemm.gemm(x.float(), packed, None, 64, isa)
    with pytest.raises(RuntimeError, match="x must be"):
        small_gemm.gemm(x.half(), packed, None, 64, isa)
    for bf16_only in set(ISAS) - set(small_gemm.available(torch.float32)):
        with pytest.raises(RuntimeError, match="has no fp32 kernel"):
            small_gemm.gemm(x.float(), small_gemm.pack(w.float()), None, 64, bf16_only)
    with pytest.raises(RuntimeError, match="bias must be"):
        small_gemm.gemm(x, packed, torch.zeros(31, dtype=torch.bfloat16), 64, isa)
    with pytest.raises(RuntimeError, match="small_gemm_silu_mul: x has K=63"):
        small_gemm.gemm_silu_mul(x[:, :63], packed, None, 64, isa)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_linear_layer_takes_the_kernel_within_its_bound_and_onednn_above_it(
    dtype: torch.dtype,
) -> None:
    isa = small_gemm.chosen(dtype)
    assert isa is not None
    n, k = 960, 576
    w, x, bias = operands(n, k, 300, seed=11, dtype=dtype)
    layer = Linear(n, k, dtype, bias=True)
    layer.weight.data = w.clone()
    assert layer.bias is not None
    layer.bias.data = bias.clone()
    layer.prepack()
    rows = small_gemm.max_rows(isa, dtype)
    packed = small_gemm.pack(w)
    if rows == small_gemm.EVERY_M:  # AMX, AVX-512F fp32: every M, its packing the only copy
        assert torch.equal(layer(x), small_gemm.gemm(x, packed, bias, k, isa))
        assert layer.weight.numel() == 0
        return
    assert torch.equal(layer(x[:rows]), small_gemm.gemm(x[:rows], packed, bias, k, isa))
    above = layer(x)  # prefill-sized: oneDNN (or F.linear), as F.linear rounds
    ref = x.double() @ w.double().T + bias.double()
    assert bool(((above.double() - ref).abs() <= bound(x, w, bias, ref)).all())
    if dtype == torch.bfloat16:
        assert (above != F.linear(x, w, bias)).float().mean().item() <= 2e-3
