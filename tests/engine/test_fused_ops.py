"""The bf16 step's fused ops (native_engine/kernels/csrc/fused_ops.cpp) against the torch ops
they replace, which round as HF does: rotary and SiLU x up to the bit; the residual add to the
bit; RMSNorm to the bit but where its fp32 sum of squares is ordered apart from torch's, then
by one bf16 rounding in a few elements. And the layers take them in bf16 only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model_config import RopeConfig
from native_engine.kernels import fused_ops
from native_engine.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm, op by op."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


DTYPES = [torch.bfloat16, torch.float32]


def assert_within_one_rounding(got: torch.Tensor, expected: torch.Tensor) -> None:
    """bf16 RMSNorm (its own sum of squares): rarely apart, and then by one rounding. fp32's
    is torch's own op: HF's bits."""
    differ = got != expected
    if got.dtype == torch.float32:
        assert not bool(differ.any()), f"{int(differ.sum())} of {got.numel()} differ"
    assert differ.float().mean().item() <= 1e-3, f"{int(differ.sum())} of {got.numel()} differ"
    step = expected.double().abs() * 2.0**-7
    assert bool(((got.double() - expected.double()).abs() <= step)[differ].all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("size", [64, 576, 960, 2048, 100])
def test_rms_norm_and_the_residual_add_before_it(size: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(size)
    x = (torch.randn(37, size, generator=gen) * torch.rand(37, 1, generator=gen) * 20).to(dtype)
    delta = torch.randn(37, size, generator=gen).to(dtype)
    weight = torch.randn(size, generator=gen).to(dtype)
    assert_within_one_rounding(fused_ops.rms_norm(x, weight, 1e-5), torch_rms_norm(x, weight, 1e-5))
    total, normed = fused_ops.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(total, x + delta)
    assert_within_one_rounding(normed, torch_rms_norm(x + delta, weight, 1e-5))
    # Strided rows (a view of wider ones) read as they lie.
    wide = torch.randn(37, size + 16, generator=gen).to(dtype)
    assert torch.equal(
        fused_ops.rms_norm(wide[:, :size], weight, 1e-5),
        fused_ops.rms_norm(wide[:, :size].contiguous(), weight, 1e-5),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_rotary_is_the_torch_ops_bit_for_bit_on_a_strided_qkv_view(
    head_dim: int, dtype: torch.dtype
) -> None:
    tokens, heads, kv = 11, 12, 3
    gen = torch.Generator().manual_seed(head_dim)
    table = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, 4096, dtype)
    cos, signed_sin = table.lookup(torch.randint(0, 4096, (tokens,), generator=gen))
    qkv = (torch.randn(tokens, (heads + kv) * head_dim, generator=gen) * 3).to(dtype)
    qk = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # as Attention splits it
    expected = qk * cos + qk.roll(head_dim // 2, -1) * signed_sin
    assert torch.equal(fused_ops.rotary(qk, cos, signed_sin), expected)
    assert torch.equal(apply_rotary(qk, cos, signed_sin), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "size"), [(1, 1536), (8, 1536), (33, 1536), (3, 96)])
def test_silu_times_up_is_the_torch_ops_bit_for_bit(
    rows: int, size: int, dtype: torch.dtype
) -> None:
    """Widths of whole 32-lane steps: torch takes a row's last width % 32 (and, where its
    threads split a large tensor, each chunk's last elements) with libm's exp, not SLEEF's, so
    its bits there depend on the position; ours are SLEEF's everywhere."""
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * size, generator=gen) * 4).to(dtype)
    gate, up = gate_up.split(size, dim=-1)
    assert torch.equal(fused_ops.silu_mul(gate_up), F.silu(gate) * up)


def test_denormal_results_are_torchs_bits_in_bf16() -> None:
    """Products and sums that land below fp32's normal range (bf16 shares its exponents): the
    kernels' one-instruction rounding flushes those to zero, so they must take the long way
    and round as torch does; signs of zero included."""
    gen = torch.Generator().manual_seed(3)

    def tiny(*shape: int) -> torch.Tensor:  # mostly denormal, some normal, some zero
        scale = torch.tensor([1e-39, 1e-37, 0.0])[torch.randint(0, 3, shape, generator=gen)]
        return (torch.randn(*shape, generator=gen) * scale).bfloat16()

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.int16)

    table = RotaryEmbedding(RopeConfig(theta=10000.0), 64, 4096, torch.bfloat16)
    cos, signed_sin = table.lookup(torch.randint(0, 4096, (9,), generator=gen))
    qk = tiny(9, 12, 64)
    expected = qk * cos + qk.roll(32, -1) * signed_sin
    assert torch.equal(bits(fused_ops.rotary(qk, cos, signed_sin)), bits(expected))
    x, delta = tiny(5, 576), tiny(5, 576)
    total, _ = fused_ops.add_rms_norm(x, delta, torch.ones(576, dtype=torch.bfloat16), 1e-5)
    assert torch.equal(bits(total), bits(x + delta))
    gate = (torch.randn(4, 96, generator=gen) * 3).bfloat16()
    up = tiny(4, 96)
    got = fused_ops.silu_mul(torch.cat([gate, up], dim=1))
    assert torch.equal(bits(got), bits(F.silu(gate) * up))


def test_fp32_silu_is_torchs_on_every_exponent() -> None:
    """Every bf16 value widened, and each with random low mantissa bits, as fp32 gates (up =
    1): at::silu's bits, infinities, NaNs, denormals and overflowing exp(-x) included."""
    every = torch.arange(1 << 16, dtype=torch.int32) << 16
    low = torch.randint(0, 1 << 16, (1 << 16,), generator=torch.Generator().manual_seed(0)).int()
    gate = torch.cat([every, every | low]).view(torch.float32).reshape(128, 1024)
    out = fused_ops.silu_mul(torch.cat([gate, torch.ones_like(gate)], dim=1))
    expected = F.silu(gate)
    same = (out.view(torch.int32) == expected.view(torch.int32)) | (out.isnan() & expected.isnan())
    assert bool(same.all()), f"{int((~same).sum())} of {gate.numel()} inputs differ"


def test_silu_is_torchs_for_every_bf16_input() -> None:
    """All 65536 bf16 values as gates (up = 1): the kernel's SiLU is at::silu's, infinities,
    NaNs, denormals and overflowing exp(-x) included."""
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate = every.reshape(64, 1024)
    out = fused_ops.silu_mul(torch.cat([gate, torch.ones_like(gate)], dim=1))
    expected = F.silu(gate)
    same = (out.view(torch.int16) == expected.view(torch.int16)) | (out.isnan() & expected.isnan())
    assert bool(same.all()), f"{int((~same).sum())} of 65536 inputs differ"


def test_the_layers_fuse_in_bf16_and_fp32_and_keep_torch_ops_in_fp16() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen)
    delta = torch.randn(5, 64, generator=gen)
    assert fused_ops.applies(x.bfloat16()) and fused_ops.applies(x)
    assert not fused_ops.applies(x.half())
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        norm = RMSNorm(64, 1e-6, dtype)
        norm.weight.copy_(torch.randn(64, generator=gen).to(dtype))
        total, normed = norm.add_forward(delta.to(dtype), x.to(dtype))
        assert torch.equal(total, x.to(dtype) + delta.to(dtype))
        assert torch.equal(normed, norm(total))
        if dtype != torch.float16:
            assert_within_one_rounding(normed, torch_rms_norm(total, norm.weight, 1e-6))
    mlp = GatedMLP(64, 96, torch.bfloat16)
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen).bfloat16() * 0.1)
    h = x.bfloat16()
    gate, up = F.linear(h, mlp.gate_up_proj.weight).split(96, dim=-1)
    assert torch.equal(mlp(h), F.linear(F.silu(gate) * up, mlp.down_proj.weight))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bad_shapes_are_refused_by_name(dtype: torch.dtype) -> None:
    x = torch.zeros(3, 64, dtype=dtype)
    with pytest.raises(RuntimeError, match="weight must be"):
        fused_ops.rms_norm(x, torch.zeros(32, dtype=dtype), 1e-6)
    with pytest.raises(RuntimeError, match="shapes differ"):
        fused_ops.add_rms_norm(x, x[:2], torch.zeros(64, dtype=dtype), 1e-6)
    with pytest.raises(RuntimeError, match="even width"):
        fused_ops.silu_mul(torch.zeros(3, 63, dtype=dtype))
    with pytest.raises(RuntimeError, match="head_dim must be even"):
        fused_ops.rotary(torch.zeros(2, 3, 63, dtype=dtype), x, x)


def test_argmax_is_torchs_with_ties_infinities_and_nans() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 49152 + 7, generator=gen)  # a tail past the last 16 lanes
    x[1, :] = 2.0  # all tied: the first
    x[2, 40] = x[2, 41] = float("inf")
    x[3, 100] = x[3, 9000] = float("nan")  # the first NaN, past a larger value
    x[3, 50] = float("inf")
    x[4, -1] = float("nan")  # in the tail
    x[5, :] = -float("inf")
    x[6, 49152 + 3] = 1e30  # the largest in the tail
    assert torch.equal(fused_ops.argmax(x), x.argmax(dim=-1))
    view = x[:, :1000]  # strided rows
    assert torch.equal(fused_ops.argmax(view), view.argmax(dim=-1))
