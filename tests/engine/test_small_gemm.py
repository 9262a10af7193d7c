"""pdserve's bf16 GEMM (native_engine/kernels/csrc/small_gemm.cpp) on every kernel this CPU
runs, every shape class (one block, a ragged tile, many tiles split unevenly over threads; K
odd, under a tile, not a tile multiple; M of decode and of prefill, on both sides of AMX's
switch from streaming to panels) and both thread counts: against an fp64 reference within one
bf16 rounding plus the fp32 sum's error bound, against ``F.linear`` in bf16 (the path it
replaces) to the bit in all but a few elements, and the same bits for a row whatever M,
whatever the thread count."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from native_engine.kernels import small_gemm
from native_engine.kernels.small_gemm import GemmIsa
from native_engine.models.linear import Linear

ISAS = small_gemm.available()
SHAPES = [(16, 64), (48, 33), (960, 576), (208, 1000), (576, 1536)]  # (N, K)
ROWS = [1, 3, 16, 17, 40, 48, 49, 64, 100, 300]  # AMX: panels above 16


def test_this_x86_cpu_runs_at_least_the_avx2_kernel() -> None:
    assert GemmIsa.AVX2 in ISAS, f"kernels here: {ISAS}"
    assert small_gemm.chosen() == max(ISAS)


@pytest.fixture(params=[1, 2], ids=lambda n: f"threads{n}")
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def operands(n: int, k: int, m: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    # Columns of different scales: the fp32 sum's rounding matters.
    w = (torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 0.2).bfloat16()
    x = (torch.randn(m, k, generator=gen) * 3).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    return w, x, bias


def bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """One bf16 rounding of the result (u = 2^-8) plus the fp32 sum's worst case over K terms
    and the bias."""
    k = x.shape[1]
    magnitude = x.double().abs() @ w.double().abs().T + bias.double().abs()
    return ref.abs() * 2.0**-8 + (k + 2) * 2.0**-24 * magnitude


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: i.name)
@pytest.mark.parametrize(("n", "k"), SHAPES, ids=lambda s: str(s))
def test_the_kernel_is_within_one_bf16_rounding_of_fp64_and_is_f_linear_but_rarely(
    isa: GemmIsa, n: int, k: int, threads: int
) -> None:
    w, x, bias = operands(n, k, max(ROWS), seed=n * k)
    packed = small_gemm.pack(w)
    ref = x.double() @ w.double().T + bias.double()
    expected = F.linear(x, w, bias)
    for m in ROWS:
        got = small_gemm.gemm(x[:m], packed, bias, k, isa)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        err = (got.double() - ref[:m]).abs()
        assert bool((err <= bound(x[:m], w, bias, ref[:m])).all()), f"M={m}: max {err.max()}"
        differ = got != expected[:m]
        assert differ.float().mean().item() <= 2e-3, f"M={m}: {int(differ.sum())} differ"
        # Where they differ, both are within the bound of the exact value: two fp32 sums in
        # other orders that round apart (a relative step would not hold near a cancellation).
        apart = (got.double() - expected[:m].double()).abs()
        assert bool((apart <= 2 * bound(x[:m], w, bias, ref[:m]))[differ].all())


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: i.name)
def test_a_row_is_the_same_bits_whatever_m_and_thread_count(isa: GemmIsa) -> None:
    n, k = 960, 576
    w, x, bias = operands(n, k, 300, seed=7)
    packed = small_gemm.pack(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = small_gemm.gemm(x, packed, bias, k, isa)
        torch.set_num_threads(1)
        assert torch.equal(small_gemm.gemm(x, packed, bias, k, isa), full)
    finally:
        torch.set_num_threads(before)
    for m in (1, 2, 5, 16, 17, 33, 48, 49, 64, 81, 129, 250):
        assert torch.equal(small_gemm.gemm(x[:m], packed, bias, k, isa), full[:m]), m
    # A row alone, from anywhere in the batch, and a batch from anywhere.
    assert torch.equal(small_gemm.gemm(x[37:38], packed, bias, k, isa), full[37:38])
    assert torch.equal(small_gemm.gemm(x[37:137], packed, bias, k, isa), full[37:137])


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: i.name)
def test_strided_rows_and_what_lies_past_k_never_reach_the_result(isa: GemmIsa) -> None:
    """x as a view into wider rows whose tail is NaN: K padded to a tile must read zeros."""
    n, k = 48, 40
    w, x, _ = operands(n, k, 5, seed=3)
    wide = torch.full((5, 96), float("nan"), dtype=torch.bfloat16)
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
    with pytest.raises(RuntimeError, match="x must be"):
        small_gemm.gemm(x.float(), packed, None, 64, isa)
    with pytest.raises(RuntimeError, match="bias must be"):
        small_gemm.gemm(x, packed, torch.zeros(31, dtype=torch.bfloat16), 64, isa)


def test_the_linear_layer_takes_the_kernel_within_its_bound_and_onednn_above_it() -> None:
    isa = small_gemm.chosen()
    assert isa is not None
    n, k = 960, 576
    w, x, bias = operands(n, k, 300, seed=11)
    layer = Linear(n, k, torch.bfloat16, bias=True)
    layer.weight.data = w.clone()
    assert layer.bias is not None
    layer.bias.data = bias.clone()
    layer.prepack()
    rows = small_gemm.max_rows(isa)
    packed = small_gemm.pack(w)
    if rows == small_gemm.EVERY_M:  # AMX: the kernel for every M, its packing the only copy
        assert torch.equal(layer(x), small_gemm.gemm(x, packed, bias, k, isa))
        assert layer.weight.numel() == 0
        return
    assert torch.equal(layer(x[:rows]), small_gemm.gemm(x[:rows], packed, bias, k, isa))
    above = layer(x)  # prefill-sized: oneDNN (or F.linear), as F.linear rounds
    differ = above != F.linear(x, w, bias)
    assert differ.float().mean().item() <= 2e-3
