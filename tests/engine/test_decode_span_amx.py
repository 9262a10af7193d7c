"""The AMX decode span (csrc/decode_span_amx.cpp) on a bf16 cache, against attention computed
exactly (float64 over the same bf16 inputs), on the shapes its tiles cut differently: query
groups of 1 to 8 heads (a values pass takes 4 at a time), up to 16 query heads (one score
tile), head_dim 64 and 128, blocks of 16 to 128 tokens, contexts ending inside a 16-token tile,
and stale slots past a context holding NaN. Each probability weighs the values as a bf16 hi +
lo pair (relative error <= 2^-16), so an output is within one bf16 ulp of the exact result
plus 2^-16 of the largest value (the pair's worst case; fp32's sums add far less), and is the
exact result rounded nearly always, as on the AVX-512 span."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from native_engine.kernels.cpu import cpu_ops, load_cpu_kernels, paged_decode_attention_cpu
from tests.engine.test_cpu_kernel_dtypes import _exact, _ulp
from tests.engine.test_cpu_kernel_spans import assert_each_sequence_is_its_own


def _amx_applies(block_size: int, head_dim: int, num_q_heads: int) -> bool:
    return bool(cpu_ops().decode_attention_amx_applies(block_size, head_dim, num_q_heads))


@pytest.fixture
def restore_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _case(
    lens: list[int], block_size: int, num_kv_heads: int, group: int, head_dim: int, seed: int
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(lens) // block_size)
    num_blocks = len(lens) * max_blocks + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).bfloat16()
    v_cache = torch.randn(shape, generator=gen).bfloat16()
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * max_blocks]
    tables = tables.view(len(lens), max_blocks).int()
    for s, n in enumerate(lens):  # stale slots past each context: NaN
        last = int(tables[s, (n - 1) // block_size])
        k_cache[last, (n - 1) % block_size + 1 :] = float("nan")
        v_cache[last, (n - 1) % block_size + 1 :] = float("nan")
    query = 3 * torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen)
    return query.bfloat16(), k_cache, v_cache, tables


@pytest.mark.usefixtures("restore_threads")
@pytest.mark.parametrize(
    "block_size, num_kv_heads, group, head_dim",
    [
        (32, 3, 3, 64),  # SmolLM2-135M
        (16, 4, 1, 128),
        (64, 2, 4, 64),
        (32, 2, 5, 128),  # a group split 4 + 1 in the values pass
        (128, 2, 8, 64),  # 16 query heads: a whole score tile
        (16, 1, 7, 64),
    ],
)
def test_the_amx_span_is_within_an_ulp_of_exact_attention(
    block_size: int, num_kv_heads: int, group: int, head_dim: int
) -> None:
    assert load_cpu_kernels()
    if not _amx_applies(block_size, head_dim, num_kv_heads * group):
        pytest.skip("no AMX here (this build or CPU): the AVX-512 span's tests cover it")
    lens = [1, 15, 16, 17, 63, 64, 65, 2 * block_size + 7, 300, 513]
    query, k_cache, v_cache, tables = _case(lens, block_size, num_kv_heads, group, head_dim, 7)
    scale = head_dim**-0.5
    exact = _exact(query, k_cache, v_cache, tables, lens, scale)
    rounded = exact.to(torch.bfloat16)
    finite = v_cache.double().nan_to_num(0.0).abs().max()
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        lens_t = torch.tensor(lens, dtype=torch.int32)
        kernel = paged_decode_attention_cpu(query, k_cache, v_cache, tables, lens_t, scale)
        assert kernel.isfinite().all(), threads
        assert ((kernel.double() - exact).abs() <= _ulp(rounded) + 2.0**-16 * finite).all()
        assert (kernel == rounded).double().mean() >= 0.99, threads


@pytest.mark.usefixtures("restore_threads")
def test_a_sequence_on_the_amx_span_is_the_same_bits_in_any_batch() -> None:
    """Spans are a fixed size and fetching ahead reads, never writes: a sequence's output is
    its own, whatever shares the call and however many threads split it."""
    assert load_cpu_kernels()
    if not _amx_applies(32, 64, 9):
        pytest.skip("no AMX here")
    lens = [290, 7, 1000, 65, 300, 16, 33]
    query, k_cache, v_cache, tables = _case(lens, 32, 3, 3, 64, 5)
    assert_each_sequence_is_its_own(query, k_cache, v_cache, tables, lens, 0.125)


def test_shapes_off_the_amx_tiles_take_the_avx512_span() -> None:
    assert load_cpu_kernels()
    if not _amx_applies(32, 64, 9):
        pytest.skip("no AMX here")
    assert not _amx_applies(8, 64, 9)  # blocks shorter than a 16-row tile
    assert not _amx_applies(256, 64, 9)  # spans longer than the scratch holds
    assert not _amx_applies(32, 96, 9)  # head_dim not 64 or 128
    assert not _amx_applies(32, 64, 17)  # more query heads than a score tile's columns
