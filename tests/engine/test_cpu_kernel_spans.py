"""The native CPU decode kernel splits long contexts into spans of blocks across threads
(flash-decoding) and merges the spans' partial softmaxes: at any thread count, with one long
context beside short ones, the result is attention computed exactly (float64), to fp32
rounding."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from native_engine.kernels.cpu import load_cpu_kernels, paged_decode_attention_cpu
from tests.engine.test_cpu_kernel_dtypes import BLOCK_SIZE, _exact

LENS = [1, 3 * BLOCK_SIZE + 5, 61 * BLOCK_SIZE + 7, BLOCK_SIZE]


@pytest.fixture
def restore_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("restore_threads")
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_spans_merge_to_exact_attention_at_any_thread_count(threads: int) -> None:
    assert load_cpu_kernels()
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(11)
    num_q_heads, num_kv_heads, head_dim = 6, 2, 32
    max_blocks = -(-max(LENS) // BLOCK_SIZE)
    num_blocks = len(LENS) * max_blocks
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    # Large logits: a span whose max is far below the sequence's must be weighted down, not
    # overflow or vanish.
    query = 4 * torch.randn(len(LENS), num_q_heads, head_dim, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen).view(len(LENS), max_blocks).int()
    lens = torch.tensor(LENS, dtype=torch.int32)
    scale = head_dim**-0.5
    kernel = paged_decode_attention_cpu(query, k_cache, v_cache, tables, lens, scale)
    exact = _exact(query, k_cache, v_cache, tables, LENS, scale)
    torch.testing.assert_close(kernel.double(), exact, rtol=1e-5, atol=1e-5)
