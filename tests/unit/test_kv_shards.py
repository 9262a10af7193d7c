"""Which shards move between engines of different tensor parallelism (``engine/kv_shards.py``),
exact values; and the pages' side of it: a head range of vLLM's CPU pages viewed as pages of
their own (``VllmKVPages.heads``), refused by name where the arrangement is not cut by heads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.kv_layout import KVCacheLayout
from engine.kv_pages import KVPages
from engine.kv_shards import ShardRead, head_range, shard_mismatch, shard_reads, tp_refusal
from vllm_engine.kv_pages import SKIP_BLOCK, PageShapeError, VllmKVPages

PAGE = "vllm-test/CPU_ATTN/BHx4x6"
HEADS = 4  # the model's KV heads


def layout(tp_size: int = 1, tp_rank: int = 0, heads: int | None = None) -> KVCacheLayout:
    per_rank = HEADS // tp_size if heads is None else heads
    return KVCacheLayout(
        "fp", "float32", 4, 2, per_rank, 3, page_layout=PAGE, tp_size=tp_size, tp_rank=tp_rank
    )


def test_the_tp_rule_maps_sizes_that_divide_and_refuses_the_rest_by_name() -> None:
    assert tp_refusal(2, 2, 2, 2) is None
    assert tp_refusal(1, 4, 2, 2) is None and tp_refusal(4, 1, 2, 2) is None
    assert tp_refusal(2, 2, 3, 1) == (
        "tp_size 2 (prefill) and tp_size 3 (decode) do not divide one another: a decode "
        "rank's heads would span a part of a prefill rank's"
    )
    # 2 KV heads on 4 ranks: each rank holds a copy of one head, not a range of them.
    assert tp_refusal(4, 1, 2, 1) == (
        "tp_size 4 is above the model's KV head count (tp_size 4 x 1 heads (prefill) != "
        "tp_size 2 x 1 heads (decode)): replicated KV heads move only between equal tp_size"
    )
    assert tp_refusal(4, 1, 4, 1) is None  # equal tp_size: rank r from rank r, copies too
    assert tp_refusal(2, 2, 2, 1) == "num_kv_heads per rank 2 (prefill) != 1 (decode)"


def test_a_decode_rank_reads_its_heads_from_the_prefill_ranks_that_hold_them() -> None:
    # Equal: rank r from rank r, the whole page.
    assert shard_reads(layout(2), layout(2, 1)) == [ShardRead(1, layout(2, 1))]
    # D > P: decode rank 3 of 4 reads shard 3 of 4, held by prefill rank 1 of 2.
    assert shard_reads(layout(2), layout(4, 3)) == [ShardRead(1, layout(4, 3))]
    assert shard_reads(layout(1), layout(4, 2)) == [ShardRead(0, layout(4, 2))]
    # P > D: decode rank 1 of 2 (2 heads) reads shards 2 and 3 of 4, one head each.
    assert shard_reads(layout(4), layout(2, 1)) == [
        ShardRead(2, layout(4, 2)),
        ShardRead(3, layout(4, 3)),
    ]
    assert [r.source_rank for r in shard_reads(layout(4), layout(1))] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="do not divide"):
        shard_reads(layout(3, heads=1), layout(2))


def test_each_side_finds_the_shard_in_its_own_heads() -> None:
    # Prefill rank 1 of 2 (heads 2, 3) holds shard 3 of 4 as its local head 1.
    assert head_range(layout(2, 1), layout(4, 3)) == (1, 1)
    # A decode engine of one rank writes shard 2 of 4 at its head 2.
    assert head_range(layout(1), layout(4, 2)) == (2, 1)
    assert head_range(layout(2, 1), layout(2, 1)) == (0, 2)  # its own: the whole page
    with pytest.raises(ValueError, match=r"shard 1 of tp_size 4 is held by rank 0, not by rank 1"):
        head_range(layout(2, 1), layout(4, 1))
    with pytest.raises(ValueError, match=r"^tp_rank 1 != 0"):  # equal tp_size: the ranks agree
        head_range(layout(2, 1), layout(2, 0))
    with pytest.raises(ValueError, match="larger than a rank of tp_size 4's"):
        head_range(layout(4, 1), layout(2, 0))
    bf16 = dataclasses.replace(layout(4, 3), dtype="bfloat16")
    with pytest.raises(ValueError, match="dtype float32 != bfloat16"):
        head_range(layout(2, 1), bf16)


def test_a_handle_is_refused_by_what_differs_besides_the_split() -> None:
    assert shard_mismatch(layout(1), layout(2, 1)) is None
    other_page = dataclasses.replace(layout(1), page_layout="vllm-test/FLASH/B4x4x6/NHC")
    message = shard_mismatch(other_page, layout(2, 1))
    assert message is not None and message.startswith(
        f"page_layout {PAGE} != vllm-test/FLASH/B4x4x6/NHC"
    )


def _pages(tp_size: int, tp_rank: int = 0, fill: bool = True) -> VllmKVPages:
    own = layout(tp_size, tp_rank)
    shape = (5, own.num_kv_heads, 4, 6)  # vLLM CPU: [blocks, heads, block_size, 2 * head_dim]
    layers = [torch.randn(shape) if fill else torch.zeros(shape) for _ in range(2)]
    return VllmKVPages(layers, own, 5)


def test_a_head_range_of_the_pages_reads_and_writes_those_heads_only() -> None:
    whole = _pages(1)
    ranks = [_pages(4, r, fill=False) for r in range(4)]
    for rank in ranks:  # each one-head rank takes its head from the four-head engine's pages
        view = whole.shard(rank.layout)
        assert view.layout == rank.layout
        rank.write_slabs(0, [0, 3], view.read_slabs(0, 4, [4, 1]))
        for layer in range(2):
            source = whole._layers[layer][[4, 1], rank.layout.tp_rank]
            assert torch.equal(rank._layers[layer][[0, 3], 0], source)
    back = _pages(1, fill=False)
    for rank in ranks:  # and the other way: each into its head of an empty engine's pages
        back.shard(rank.layout).write_slabs(0, [SKIP_BLOCK, 2], rank.read_slabs(0, 4, [2, 0]))
    for layer in range(2):
        assert torch.equal(back._layers[layer][2], whole._layers[layer][4])
        assert not back._layers[layer][[0, 1, 3, 4]].any()  # no other block written


def test_pages_not_cut_by_heads_refuse_a_head_range_by_name() -> None:
    # vLLM's LBNHC layout (FlashAttention's default): [blocks, heads, block, 2 * dim] logically,
    # tokens outside heads in memory.
    cuda = [torch.zeros(5, 4, HEADS, 6).transpose(1, 2) for _ in range(2)]
    pages = VllmKVPages(cuda, dataclasses.replace(layout(1), page_layout="x"), 5)
    with pytest.raises(PageShapeError, match="not cut by heads"):
        pages.shard(dataclasses.replace(layout(2, 1), page_layout="x"))

    class Native(KVPages):
        def __init__(self) -> None:
            self.layout, self.num_blocks = layout(1), 5

        def read_slabs(self, first: int, num_slabs: int, block_ids: list[int]) -> torch.Tensor:
            raise NotImplementedError

        def write_slabs(self, first: int, block_ids: list[int], data: torch.Tensor) -> None:
            raise NotImplementedError

    with pytest.raises(ValueError, match="KV moves only between engines of the same tensor"):
        Native().shard(layout(2, 0))
    assert Native().shard(layout(1)).layout == layout(1)
