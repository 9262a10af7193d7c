"""The native CPU decode kernel in bf16 and fp16, against attention computed exactly (float64
over the same 16-bit inputs), with GQA and contexts on and across block boundaries. It
accumulates in fp32 and rounds once: nearly every element is the exact result rounded to the
dtype, and none is more than one unit in the last place from it. The torch path (fused SDPA in
the dtype) rounds along the way: it is within a few 16-bit ulps of the output's magnitude."""

from __future__ import annotations

import pytest
import torch

from native_engine.attention import decode_gather_inputs, paged_decode_attention_torch
from native_engine.kernels.cpu import load_cpu_kernels, paged_decode_attention_cpu
from native_engine.kv_cache import LayerCache

BLOCK_SIZE = 16
LENS = [1, BLOCK_SIZE, BLOCK_SIZE + 1, 3 * BLOCK_SIZE + 5]


def _exact(query, k_cache, v_cache, tables, lens, scale):  # type: ignore[no-untyped-def]
    out = []
    block_size, group = k_cache.shape[1], query.shape[1] // k_cache.shape[2]
    for s, n in enumerate(lens):
        blocks = tables[s, : -(-n // block_size)].long()
        k = k_cache[blocks].reshape(-1, *k_cache.shape[2:])[:n].double()
        v = v_cache[blocks].reshape(-1, *v_cache.shape[2:])[:n].double()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", query[s].double(), k) * scale
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v))
    return torch.stack(out)


def _ulp(rounded: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each (16-bit) value, as float64."""
    mantissa = {torch.bfloat16: 7, torch.float16: 10}[rounded.dtype]
    magnitude = rounded.double().abs().clamp_min(2.0**-14)
    return torch.exp2(torch.floor(torch.log2(magnitude)) - mantissa)


# The torch path's error bound, relative to the largest output: its intermediates are rounded.
TORCH_PATH_TOLERANCE = {torch.bfloat16: 2**-6, torch.float16: 2**-9}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
# (10, 2): a group of five query heads, more than the AVX-512 span holds in registers at once.
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 4), (8, 2), (10, 2)])
# 64 and 128 take the AVX-512 span (decode_span.cpp) where the build has it; 96 the portable loop.
@pytest.mark.parametrize("head_dim", [64, 128, 96])
def test_16_bit_decode_is_within_an_ulp_of_exact_attention(
    dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    assert load_cpu_kernels()
    gen = torch.Generator().manual_seed(3)
    num_blocks = 24
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen).to(dtype)
    query = torch.randn(len(LENS), num_q_heads, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: 4 * len(LENS)].view(len(LENS), 4)
    tables, lens = tables.int(), torch.tensor(LENS, dtype=torch.int32)
    scale = head_dim**-0.5
    kernel = paged_decode_attention_cpu(query, k_cache, v_cache, tables, lens, scale)
    assert kernel.dtype == dtype and kernel.shape == query.shape
    exact = _exact(query, k_cache, v_cache, tables, LENS, scale)
    rounded = exact.to(dtype)
    # Where an output is small beside the values it sums (cancellation), fp32's own rounding
    # of those sums (about 2^-24 of each, over a few dozen tokens) adds to the final rounding.
    fp32_sums = 2.0**-18 * v_cache.double().abs().max()
    assert ((kernel.double() - exact).abs() <= _ulp(rounded) + fp32_sums).all()
    assert (kernel == rounded).double().mean() >= 0.99
    table, mask = decode_gather_inputs(tables, lens, max(LENS), BLOCK_SIZE)
    torch_path = paged_decode_attention_torch(
        query, LayerCache(k_cache, v_cache), table, mask, scale
    )
    bound = TORCH_PATH_TOLERANCE[dtype] * exact.abs().max()
    assert (torch_path.double() - exact).abs().max() <= bound


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_strided_query_and_int64_tables_give_the_contiguous_bits(dtype: torch.dtype) -> None:
    """The kernel converts its inputs itself (the fused decode layer's query is a view of the
    rotated q|k rows): a strided query, int64 tables and lengths read as their contiguous
    int32 copies do."""
    assert load_cpu_kernels()
    gen = torch.Generator().manual_seed(5)
    num_blocks, heads, kv_heads, dim = 24, 9, 3, 64
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, dim, generator=gen).to(dtype)
    rows = torch.randn(len(LENS), heads + kv_heads, dim, generator=gen).to(dtype)
    query = rows[:, :heads]  # q of q|k: rows of (heads + kv_heads) x dim
    assert not query.is_contiguous()
    tables = torch.randperm(num_blocks, generator=gen)[: 4 * len(LENS)].view(len(LENS), 4)
    lens = torch.tensor(LENS)
    want = paged_decode_attention_cpu(
        query.contiguous(), k_cache, v_cache, tables.int(), lens.int(), dim**-0.5
    )
    got = paged_decode_attention_cpu(query, k_cache, v_cache, tables, lens, dim**-0.5)
    assert got.dtype == dtype and torch.equal(got, want)


def test_a_quantized_cache_in_the_kernel_needs_a_float32_query() -> None:
    assert load_cpu_kernels()
    codes = torch.zeros(2, BLOCK_SIZE, 1, 64, dtype=torch.uint8)
    scales = torch.ones(2, BLOCK_SIZE, 1)
    with pytest.raises(RuntimeError, match="float32 query only"):
        paged_decode_attention_cpu(
            torch.zeros(1, 1, 64, dtype=torch.bfloat16),
            codes,
            codes,
            torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
            1.0,
            scales,
            scales,
            torch.zeros(256),
        )
