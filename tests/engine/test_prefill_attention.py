"""The AMX prefill attention (native_engine/kernels/prefill_attention.py) against a float64
reference, beside torch's SDPA in bf16 on the same inputs; and a row's bits whatever chunk it
comes in, at any thread count."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.config import AttentionBackend
from native_engine.attention import (
    AttentionMetadata,
    PrefillSpan,
    PrefillTables,
    paged_attention,
)
from native_engine.attention import (
    prefill_attention as one_span,
)
from native_engine.kernels import prefill_attention
from native_engine.kv_cache import LayerCache

pytestmark = pytest.mark.skipif(
    not prefill_attention.available(), reason="the prefill attention kernel needs AMX"
)


def paged(
    keys: torch.Tensor, values: torch.Tensor, block_size: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """keys/values [ctx, kv_heads, dim] scattered into a cache of shuffled blocks whose other
    slots hold NaN (stale rows must not reach a result)."""
    ctx, kv_heads, dim = keys.shape
    used = -(-ctx // block_size)
    num_blocks = used + 5
    ids = torch.randperm(num_blocks, generator=gen)[:used]
    k_cache = torch.full((num_blocks, block_size, kv_heads, dim), float("nan"), dtype=keys.dtype)
    v_cache = k_cache.clone()
    slots = ids[torch.arange(ctx) // block_size] * block_size + torch.arange(ctx) % block_size
    k_cache.view(-1, kv_heads, dim)[slots] = keys
    v_cache.view(-1, kv_heads, dim)[slots] = values
    return k_cache, v_cache, ids


def one(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    ids: torch.Tensor,
    ctx: int,
    scale: float,
) -> torch.Tensor:
    """The kernel on one sequence: a batch of one."""
    return prefill_attention.paged_prefill_attention(
        query,
        k_cache,
        v_cache,
        ids[None],
        torch.tensor([0, query.shape[0]]),
        torch.tensor([ctx]),
        scale,
    )


def reference(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    q_len, ctx = query.shape[0], keys.shape[0]
    mask = torch.arange(ctx)[None, :] <= torch.arange(q_len)[:, None] + (ctx - q_len)
    q, k, v = (t.to(dtype).transpose(0, 1)[None] for t in (query, keys, values))
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        scale=query.shape[-1] ** -0.5,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


@pytest.mark.parametrize(
    ("q_len", "ctx", "heads", "kv_heads", "dim", "block_size"),
    [
        (1, 1, 9, 3, 64, 32),
        (17, 17, 9, 3, 64, 32),
        (256, 256, 9, 3, 64, 32),
        (100, 300, 9, 3, 64, 16),  # cached context, blocks smaller than a span
        (5, 70, 4, 4, 32, 64),
        (48, 130, 8, 2, 128, 32),
    ],
)
def test_within_sdpas_error_of_float64(
    q_len: int, ctx: int, heads: int, kv_heads: int, dim: int, block_size: int
) -> None:
    gen = torch.Generator().manual_seed(q_len * 1000 + ctx)
    keys = torch.randn(ctx, kv_heads, dim, generator=gen).bfloat16()
    values = torch.randn(ctx, kv_heads, dim, generator=gen).bfloat16()
    # A strided query, as the model passes it: a view of q|k rows.
    qk = torch.randn(q_len, heads + kv_heads, dim, generator=gen).bfloat16()
    query = qk[:, :heads]
    k_cache, v_cache, ids = paged(keys, values, block_size, gen)
    out = one(query, k_cache, v_cache, ids, ctx, dim**-0.5)
    exact = reference(query, keys, values, torch.float64)
    sdpa = reference(query, keys, values, torch.bfloat16)
    assert not out.isnan().any()
    err, sdpa_err = (out.double() - exact).abs().max(), (sdpa.double() - exact).abs().max()
    assert err <= 1.5 * sdpa_err + 1e-3, (err, sdpa_err)


def prompt(seed: int, ctx: int) -> Callable[[int, int], torch.Tensor]:
    """A prompt of ctx tokens (SmolLM2's heads) in a paged cache: attention(start, n) is the
    kernel's output for its tokens [start, start + n) as one chunk."""
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = 9, 3, 64
    keys = torch.randn(ctx, kv_heads, dim, generator=gen).bfloat16()
    values = torch.randn(ctx, kv_heads, dim, generator=gen).bfloat16()
    query = torch.randn(ctx, heads, dim, generator=gen).bfloat16()
    k_cache, v_cache, ids = paged(keys, values, 32, gen)

    def attention(start: int, n: int) -> torch.Tensor:
        return one(query[start : start + n], k_cache, v_cache, ids, start + n, dim**-0.5)

    return attention


def test_a_rows_bits_do_not_depend_on_the_chunking() -> None:
    attention = prompt(0, 300)
    whole = attention(0, 300)
    for cuts in ([7, 50, 64, 3, 176], [1] * 20 + [280], [299, 1], [16, 16, 268]):
        parts, start = [], 0
        for n in cuts:
            parts.append(attention(start, n))
            start += n
        assert torch.equal(torch.cat(parts), whole), cuts


def test_bad_arguments_are_refused_by_name() -> None:
    k_cache = torch.zeros(4, 32, 3, 64, dtype=torch.bfloat16)
    query = torch.zeros(8, 9, 64, dtype=torch.bfloat16)
    ids = torch.tensor([0, 1])
    call = one
    with pytest.raises(RuntimeError, match="bad lengths"):
        call(query, k_cache, k_cache, ids, 65, 0.125)  # past the blocks given
    with pytest.raises(RuntimeError, match="bad lengths"):
        call(query, k_cache, k_cache, ids, 7, 0.125)  # shorter than the chunk
    with pytest.raises(RuntimeError, match="block id 9 out of range"):
        call(query, k_cache, k_cache, torch.tensor([0, 9]), 40, 0.125)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 32"):
        odd = torch.zeros(4, 32, 3, 48, dtype=torch.bfloat16)
        call(torch.zeros(8, 9, 48, dtype=torch.bfloat16), odd, odd, ids, 8, 0.125)
    with pytest.raises(RuntimeError, match="scale must be > 0"):
        call(query, k_cache, k_cache, ids, 8, -0.125)
    batch = prefill_attention.paged_prefill_attention
    tables, lens = torch.tensor([[0, 1], [2, 3]]), torch.tensor([8, 40])
    with pytest.raises(RuntimeError, match="query_starts must run from 0"):
        batch(query, k_cache, k_cache, tables, torch.tensor([0, 4, 7]), lens, 0.125)
    with pytest.raises(RuntimeError, match="sequence 1 q_len 0"):
        batch(query, k_cache, k_cache, tables, torch.tensor([0, 8, 8]), lens, 0.125)
    with pytest.raises(RuntimeError, match="context_lens \\[seqs\\]"):
        batch(query, k_cache, k_cache, tables, torch.tensor([0, 4, 8]), lens[:1], 0.125)
    with pytest.raises(RuntimeError, match="must be contiguous int64"):
        batch(query, k_cache, k_cache, tables.int(), torch.tensor([0, 4, 8]), lens, 0.125)


def test_a_batch_of_sequences_is_each_sequence_alone_bit_for_bit() -> None:
    """Sequences of different lengths, fresh and with cached context, in one call: each one's
    rows are its call alone's bits, whichever sequences share the call."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, block_size = 9, 3, 64, 32
    cases = [(256, 256), (17, 17), (100, 300), (1, 45), (64, 64)]  # (chunk, context)
    width = max(-(-ctx // block_size) for _, ctx in cases)
    num_blocks = sum(-(-ctx // block_size) for _, ctx in cases) + 3
    k_cache = torch.full((num_blocks, block_size, kv_heads, dim), float("nan"))
    k_cache = k_cache.bfloat16()
    v_cache = k_cache.clone()
    free = torch.randperm(num_blocks, generator=gen).tolist()
    queries, tables = [], []
    for q_len, ctx in cases:
        ids = torch.tensor([free.pop() for _ in range(-(-ctx // block_size))])
        slots = ids[torch.arange(ctx) // block_size] * block_size + torch.arange(ctx) % block_size
        k_cache.view(-1, kv_heads, dim)[slots] = torch.randn(
            ctx, kv_heads, dim, generator=gen
        ).bfloat16()
        v_cache.view(-1, kv_heads, dim)[slots] = torch.randn(
            ctx, kv_heads, dim, generator=gen
        ).bfloat16()
        queries.append(torch.randn(q_len, heads, dim, generator=gen).bfloat16())
        tables.append(torch.cat([ids, torch.zeros(width - len(ids), dtype=torch.long)]))
    alone = [
        one(q, k_cache, v_cache, t, ctx, dim**-0.5)
        for q, t, (_, ctx) in zip(queries, tables, cases, strict=True)
    ]
    for order in ([0, 1, 2, 3, 4], [3, 0, 4, 2, 1]):
        out = prefill_attention.paged_prefill_attention(
            torch.cat([queries[i] for i in order]),
            k_cache,
            v_cache,
            torch.stack([tables[i] for i in order]),
            torch.tensor([0] + [queries[i].shape[0] for i in order]).cumsum(0),
            torch.tensor([cases[i][1] for i in order]),
            dim**-0.5,
        )
        assert not out.isnan().any()
        assert torch.equal(out, torch.cat([alone[i] for i in order])), order


def test_a_layers_prefills_take_one_call_with_each_spans_bits() -> None:
    """paged_attention on the CPU backend with the step's PrefillTables (one kernel call) gives
    every span the bits of its own call (the path without tables), a decode-free step of a
    fresh prompt, a chunk over cached context and a one-token chunk."""
    gen = torch.Generator().manual_seed(9)
    heads, kv_heads, dim, block_size = 9, 3, 64, 32
    cases = [(40, 40), (33, 100), (1, 70)]  # (chunk, context)
    num_blocks = 16
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).bfloat16()
    free = torch.randperm(num_blocks, generator=gen).tolist()
    spans, slots, start = [], [], 0
    for q_len, ctx in cases:
        ids = torch.tensor([free.pop() for _ in range(-(-ctx // block_size))])
        spans.append(PrefillSpan(start, q_len, ctx, ids))
        chunk = torch.arange(ctx - q_len, ctx)
        slots.append(ids[chunk // block_size] * block_size + chunk % block_size)
        start += q_len
    tables = PrefillTables.of(spans)
    assert tables.query_starts.tolist() == [0, 40, 73, 74]
    assert tables.context_lens.tolist() == [40, 100, 70]
    assert tables.block_tables.shape == (3, 4) and tables.block_tables[0, 2:].tolist() == [0, 0]
    query = torch.randn(start, heads, dim, generator=gen).bfloat16()
    key = torch.randn(start, kv_heads, dim, generator=gen).bfloat16()
    value = torch.randn(start, kv_heads, dim, generator=gen).bfloat16()
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        prefills=tuple(spans),
        num_prefill_tokens=start,
        decode_block_tables=torch.zeros(0, 1, dtype=torch.int32),
        decode_context_lens=torch.zeros(0, dtype=torch.int32),
        backend=AttentionBackend.CPU,
        prefill_tables=tables,
    )
    cache = LayerCache(k_cache, v_cache)
    out = paged_attention(query, key, value, cache, meta, dim**-0.5)  # stores the chunks' K/V
    for span in spans:
        rows = slice(span.query_start, span.query_start + span.query_len)
        alone = one_span(
            query[rows], key[rows], value[rows], cache, span, dim**-0.5, AttentionBackend.CPU
        )
        assert torch.equal(out[rows], alone), span.context_len


def test_the_op_asks_for_the_tile_state_itself() -> None:
    """Called first thing in a process (no GEMM or availability check before it to ask the
    kernel for AMX's tile state), it must still run: a tile op without that is SIGILL."""
    code = (
        "import torch\n"
        "from native_engine.kernels.cpu import cpu_ops\n"
        "k = torch.zeros(2, 32, 3, 64, dtype=torch.bfloat16)\n"
        "q = torch.ones(8, 9, 64, dtype=torch.bfloat16)\n"
        "ids, starts, lens = torch.tensor([[0, 1]]), torch.tensor([0, 8]), torch.tensor([8])\n"
        "out = cpu_ops().paged_prefill_attention_bf16(q, k, k, ids, starts, lens, 0.125)\n"
        "assert out.shape == (8, 9, 64) and bool((out == 0).all())\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_rows_bits_do_not_depend_on_the_thread_count() -> None:
    attention = prompt(1, 200)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(attention(0, 200))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
