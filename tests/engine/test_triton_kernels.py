"""Triton KV-store and paged decode attention vs. naive torch references.

Runs on CPU through the Triton interpreter, so shapes stay tiny.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede any triton import

import math

import pytest
import torch
import triton  # noqa: F401  - a dev dependency: a missing triton must fail, not skip

import native_engine.kernels as kernels
from native_engine.kernels import paged_decode_attention, store_kv

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
TOLS = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3)}


def _rand(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def _make_paged_cache(
    context_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches plus a shuffled block table covering `context_lens`.

    Every cache slot that no sequence attends to is NaN, and block-table padding points at
    real (NaN-holding) blocks, so reading anything outside a context poisons the output.
    """
    blocks_per_seq = [math.ceil(n / block_size) for n in context_lens]
    max_blocks = max(blocks_per_seq) + 1  # +1 guarantees at least one padding column
    num_blocks = sum(blocks_per_seq) + 2  # spare blocks that no sequence owns
    perm = torch.randperm(num_blocks, generator=gen)
    k_cache = _rand(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    v_cache = _rand(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    used = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    spare = perm[-1].item()
    tables = torch.full((len(context_lens), max_blocks), spare, dtype=torch.int32)
    start = 0
    for s, (n, nb) in enumerate(zip(context_lens, blocks_per_seq, strict=True)):
        blocks = perm[start : start + nb]
        start += nb
        tables[s, :nb] = blocks.to(torch.int32)
        slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:n]
        used[slots] = True
    for cache in (k_cache, v_cache):
        cache.view(-1, num_kv_heads, head_dim)[~used.to(DEVICE)] = float("nan")
    return k_cache, v_cache, tables.to(DEVICE)


def _reference_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = query.shape[1] // num_kv_heads
    outs = []
    for s in range(query.shape[0]):
        n = int(context_lens[s])
        blocks = block_tables[s, : math.ceil(n / block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].double()  # [n, Hkv, D]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].double()
        k = k.repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", query[s].double(), k) * scale  # [Hq, n]
        outs.append(torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v))
    return torch.stack(outs).to(query.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim", "block_size", "context_lens"),
    [
        (4, 2, 16, 4, [7, 8, 1]),  # GQA; mid-block, exact boundary, single token
        (2, 2, 24, 4, [13, 4, 21]),  # MHA; non-power-of-two head_dim; 6 blocks
        (8, 2, 32, 16, [17, 32, 5]),  # group of 4, realistic block size
    ],
)
def test_paged_decode_attention_matches_reference(
    dtype: torch.dtype,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    context_lens: list[int],
) -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, tables = _make_paged_cache(
        context_lens, block_size, num_kv_heads, head_dim, dtype, gen
    )
    query = _rand(len(context_lens), num_q_heads, head_dim, dtype=dtype, gen=gen)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5

    out = paged_decode_attention(query, k_cache, v_cache, tables, lens, scale)

    assert out.shape == query.shape and out.dtype == dtype
    assert torch.isfinite(out).all(), "kernel read a slot outside some context"
    expected = _reference_decode(query, k_cache, v_cache, tables, lens, scale)
    rtol, atol = TOLS[dtype]
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)


def test_paged_decode_attention_large_logits_is_stable() -> None:
    # Scores around +-100 overflow exp() unless the running max is subtracted correctly.
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache, tables = _make_paged_cache([11, 6], 4, 1, 16, torch.float32, gen)
    query = _rand(2, 2, 16, dtype=torch.float32, gen=gen) * 30
    lens = torch.tensor([11, 6], dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(query, k_cache, v_cache, tables, lens, 1.0)
    expected = _reference_decode(query, k_cache, v_cache, tables, lens, 1.0)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 24])
def test_store_kv_writes_slots_and_skips_negative(dtype: torch.dtype, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(2)
    num_blocks, block_size, num_kv_heads, num_tokens = 5, 4, 2, 7
    # key/value are strided slices of a fused projection, as a model would hand them over.
    fused = _rand(num_tokens, 3 * num_kv_heads, head_dim, dtype=dtype, gen=gen)
    key, value = fused[:, :num_kv_heads], fused[:, num_kv_heads : 2 * num_kv_heads]
    k_cache = _rand(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    v_cache = _rand(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[1, 4]] = -1
    slot_mapping = slots.to(device=DEVICE, dtype=torch.int64)

    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k.view(-1, num_kv_heads, head_dim)[slot] = key[i]
            expected_v.view(-1, num_kv_heads, head_dim)[slot] = value[i]

    store_kv(key, value, k_cache, v_cache, slot_mapping)

    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


def test_store_then_decode_round_trip() -> None:
    # Prefill-like write of a whole sequence through store_kv, then decode over it.
    gen = torch.Generator().manual_seed(3)
    block_size, num_kv_heads, head_dim, n = 4, 2, 16, 10
    k_cache = torch.zeros(6, block_size, num_kv_heads, head_dim, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    table = torch.tensor([[4, 0, 2, 0]], dtype=torch.int32, device=DEVICE)
    pos = torch.arange(n, device=DEVICE)
    slot_mapping = table[0, pos // block_size].long() * block_size + pos % block_size
    key = _rand(n, num_kv_heads, head_dim, dtype=torch.float32, gen=gen)
    value = _rand(n, num_kv_heads, head_dim, dtype=torch.float32, gen=gen)
    store_kv(key, value, k_cache, v_cache, slot_mapping)

    query = _rand(1, 4, head_dim, dtype=torch.float32, gen=gen)
    lens = torch.tensor([n], dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(query, k_cache, v_cache, table, lens, 0.25)

    k = key.repeat_interleave(2, dim=1).double()  # [n, Hq, D]
    v = value.repeat_interleave(2, dim=1).double()
    probs = (torch.einsum("hd,nhd->hn", query[0].double(), k) * 0.25).softmax(-1)
    expected = torch.einsum("hn,nhd->hd", probs, v).float()[None]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_missing_triton_raises_runtime_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    x = torch.zeros(1, 1, 4)
    with pytest.raises(RuntimeError, match="triton"):
        kernels.store_kv(x, x, x[None], x[None], torch.zeros(1, dtype=torch.long))
