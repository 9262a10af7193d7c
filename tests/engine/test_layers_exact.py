"""The engine's RMSNorm and rotary embedding against HF transformers' own code, bit for bit,
in every model dtype: the fused forms (one ``rms_norm`` kernel; one roll against a signed sin
table, queries and keys rotated side by side) round exactly as HF does op by op. In bf16 on the
CPU the norm is pdserve's C++ op, whose fp32 sum of squares is torch's order where the compiler
vectorizes it so (this box) and otherwise moves a result by one bf16 rounding, rarely
(``tests/engine/test_fused_ops.py`` bounds that): here it is held to the rarely."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from engine.model_config import RopeConfig
from native_engine.models.layers import RMSNorm, RotaryEmbedding, apply_rotary
from tests.engine.test_fused_ops import assert_within_one_rounding

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("size", [64, 576, 960, 2048])
def test_rms_norm_is_hf_bit_for_bit(dtype: torch.dtype, size: int) -> None:
    gen = torch.Generator().manual_seed(size)
    # Rows of very different scales: the fp32 sum of squares and its rounding matter.
    x = torch.randn(37, size, generator=gen) * torch.rand(37, 1, generator=gen) * 20
    x = x.to(dtype)
    weight = torch.randn(size, generator=gen).to(dtype)
    ours = RMSNorm(size, 1e-5, dtype)
    hf = LlamaRMSNorm(size, eps=1e-5).to(dtype)
    ours.weight.copy_(weight)
    with torch.no_grad():
        hf.weight.copy_(weight)
        expected = hf(x)
    got = ours(x)
    assert got.dtype == expected.dtype == dtype
    if dtype == torch.bfloat16:
        assert_within_one_rounding(got, expected)
    else:
        assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_is_hf_bit_for_bit_for_queries_and_keys_side_by_side(
    dtype: torch.dtype, head_dim: int
) -> None:
    num_tokens, num_q, num_kv = 11, 9, 3
    gen = torch.Generator().manual_seed(head_dim)
    rope = RopeConfig(theta=10000.0)
    table = RotaryEmbedding(rope, head_dim, 4096, dtype)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    qk = torch.randn(num_tokens, num_q + num_kv, head_dim, generator=gen).to(dtype)
    cos, signed_sin = table.lookup(positions)
    q, k = apply_rotary(qk, cos, signed_sin).split([num_q, num_kv], dim=1)

    # HF: [batch, heads, tokens, head_dim], its tables from the same fp32 frequencies.
    half = head_dim // 2
    sin = torch.cat((-signed_sin[..., :half], signed_sin[..., half:]), -1)  # the plain table
    hf_q, hf_k = apply_rotary_pos_emb(
        qk[:, :num_q].transpose(0, 1)[None],
        qk[:, num_q:].transpose(0, 1)[None],
        cos.squeeze(1)[None],
        sin.squeeze(1)[None],
    )
    assert torch.equal(q, hf_q[0].transpose(0, 1))
    assert torch.equal(k, hf_k[0].transpose(0, 1))


def test_the_signed_table_is_the_plain_one_with_its_first_half_negated() -> None:
    table = RotaryEmbedding(RopeConfig(theta=10000.0), 64, 128, torch.float32)
    positions = torch.arange(128, dtype=torch.float32)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    freqs = torch.outer(positions, inv_freq)
    plain = torch.cat((freqs, freqs), -1).sin()
    assert torch.equal(table.signed_sin[:, 32:], plain[:, 32:])
    assert torch.equal(table.signed_sin[:, :32], -plain[:, :32])
