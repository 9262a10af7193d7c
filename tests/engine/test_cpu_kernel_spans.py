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


@pytest.mark.usefixtures("restore_threads")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 96])  # the AVX-512 span, and the portable loop
def test_a_sequence_is_the_same_bits_in_any_batch_at_any_thread_count(
    dtype: torch.dtype, head_dim: int
) -> None:
    """Spans are a fixed size: a sequence's partial sums and their merge are its own, so its
    output does not move with the batch around it (the batch-invariance bf16 needs)."""
    assert load_cpu_kernels()
    gen = torch.Generator().manual_seed(5)
    num_q_heads, num_kv_heads = 9, 3
    lens = [290, 7, 1000, 65, 300, 16]
    max_blocks = -(-max(lens) // BLOCK_SIZE)
    num_blocks = len(lens) * max_blocks
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    query = 3 * torch.randn(len(lens), num_q_heads, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen).view(len(lens), max_blocks).int()
    assert_each_sequence_is_its_own(query, k_cache, v_cache, tables, lens, head_dim**-0.5)


def assert_each_sequence_is_its_own(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: list[int],
    scale: float,
) -> None:
    """Each sequence alone, and the 5th, 1st and 3rd together, give the bits the whole batch
    gives them, at 1, 2 and 3 threads (the caller restores the thread count)."""

    def attend(rows: list[int]) -> torch.Tensor:
        picked = torch.tensor(rows)
        lens_t = torch.tensor([lens[r] for r in rows], dtype=torch.int32)
        return paged_decode_attention_cpu(
            query[picked], k_cache, v_cache, tables[picked], lens_t, scale
        )

    torch.set_num_threads(2)
    batch = attend(list(range(len(lens))))
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        for r in range(len(lens)):
            assert torch.equal(attend([r]), batch[r : r + 1]), (threads, r)
        assert torch.equal(attend([4, 0, 2]), batch[[4, 0, 2]]), threads
