"""Peer pull, the engines' side (native_engine/prefix_share.py): engine B computed a prompt and
lends its cached blocks; engine A borrows them into its own prefix cache and then computes only
the rest. A's output is one engine's (greedy and seeded); leases pin, share and free exactly
once; a pull that fails publishes nothing and leaks nothing."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import SamplingParams
from engine.serving_engine import PeerPullUnsupported
from native_engine import LLM
from native_engine.llm_engine import LLMEngine
from native_engine.prefix_share import PrefixShare


def _pull(puller: LLMEngine, holder: LLMEngine, prompt: list[int], lease: str) -> int:
    """Borrows what ``puller`` lacks of ``prompt``'s cached blocks from ``holder``; returns
    the blocks written. The lease and the borrow are given back."""
    give, take = PrefixShare(holder), PrefixShare(puller)
    num_blocks = len(prompt) // puller.block_size
    borrowed = take.borrow(lease, prompt, num_blocks)
    assert borrowed is not None
    written = 0
    if borrowed.block_ids:
        lent = give.lend(lease, prompt, borrowed.first_block, num_blocks).block_ids
        assert len(lent) == len(borrowed.block_ids)
        for layer in range(holder.kv_layout.num_layers):
            puller.kv_cache.write_layer(
                layer, borrowed.block_ids, holder.kv_cache.read_layer(layer, lent)
            )
        holder.free_pinned(lease)
        take.landed(lease, len(lent))
        written = len(lent)
    take.give_back(lease)
    return written


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=99, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_a_pulled_prefix_is_computed_once_and_the_output_is_one_engines(
    llama_dir: Path, make_llm: Callable[..., LLM], params: SamplingParams
) -> None:
    holder, puller, reference = (make_llm(llama_dir) for _ in range(3))
    size = puller.engine.block_size
    rng = random.Random(11)
    prompt = [rng.randrange(3, 1000) for _ in range(3 * size + 5)]
    want = reference.generate([prompt], params)[0].token_ids
    holder.generate([prompt], SamplingParams(max_tokens=1))  # its blocks now cached on B
    assert _pull(puller.engine, holder.engine, prompt, "pull-1") == 3
    assert puller.generate([prompt], params)[0].token_ids == want
    stats = puller.engine.stats()
    assert stats.num_prompt_tokens_computed == 5  # only what no block of B held
    assert stats.num_prefix_hit_tokens == 3 * size


def test_a_puller_pulls_only_what_it_lacks(llama_dir: Path, make_llm: Callable[..., LLM]) -> None:
    holder, puller = make_llm(llama_dir), make_llm(llama_dir)
    size = puller.engine.block_size
    prompt = list(range(10, 10 + 4 * size + 1))
    holder.generate([prompt], SamplingParams(max_tokens=1))
    puller.generate([prompt[: 2 * size + 1]], SamplingParams(max_tokens=1))  # 2 blocks here
    share = PrefixShare(puller.engine)
    cached = puller.engine.block_manager.num_cached_blocks
    borrowed = share.borrow("b", prompt, 4)
    assert borrowed is not None and borrowed.first_block == 2 and len(borrowed.block_ids) == 2
    share.give_back("b")  # never landed: nothing published
    assert puller.engine.block_manager.num_cached_blocks == cached
    assert _pull(puller.engine, holder.engine, prompt, "pull-2") == 2
    assert share.borrow("again", prompt, 4) == type(borrowed)(4, [])  # all cached now


def test_leases_pin_share_and_free_exactly_once(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    holder = make_llm(llama_dir, num_blocks=16)
    engine, size = holder.engine, holder.engine.block_size
    prompt = list(range(100, 100 + 2 * size + 1))
    holder.generate([prompt], SamplingParams(max_tokens=1))
    share = PrefixShare(engine)
    one, two = share.lend("l1", prompt, 0, 2).block_ids, share.lend("l2", prompt, 0, 2).block_ids
    assert one == two and len(one) == 2  # one copy, a reference each
    assert [engine.block_manager.blocks[b].ref_count for b in one] == [2, 2]
    snapshot = [engine.kv_cache.read_layer(0, one).clone()]
    # Other prompts fill the cache: a leased block is never handed out again.
    for i in range(6):
        holder.generate(
            [list(range(400 + 40 * i, 400 + 40 * i + 2 * size))], SamplingParams(max_tokens=1)
        )
    assert engine.kv_cache.read_layer(0, one).equal(snapshot[0])
    with pytest.raises(ValueError, match="in use"):
        share.lend("l1", prompt, 0, 2)
    engine.free_pinned("l1")
    engine.free_pinned("l2")
    with pytest.raises(KeyError):
        engine.free_pinned("l2")  # exactly once
    assert share.lend("l3", prompt, 5, 2).block_ids == [] and "l3" not in engine.pinned
    with pytest.raises(ValueError, match="vocabulary"):
        share.lend("l4", [10**9] * (2 * size), 0, 2)  # ids outside the vocabulary: named


def test_a_failed_pull_publishes_nothing_and_a_cache_without_prefixes_refuses(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    puller = make_llm(llama_dir)
    size = puller.engine.block_size
    prompt = list(range(300, 300 + 2 * size + 1))
    share = PrefixShare(puller.engine)
    manager = puller.engine.block_manager
    free = manager.num_free_blocks
    borrowed = share.borrow("b", prompt, 2)
    assert borrowed is not None and len(borrowed.block_ids) == 2
    assert manager.num_free_blocks == free - 2
    # The fill failed: the blocks go back at once (a full cache must seat the request).
    assert share.landed("b", 0) == [] and manager.num_free_blocks == free
    share.give_back("b")
    share.give_back("b")  # idempotent
    assert puller.engine.block_manager.num_cached_blocks == 0
    plain = make_llm(llama_dir, enable_prefix_caching=False)
    with pytest.raises(PeerPullUnsupported, match="prefix cach"):
        PrefixShare(plain.engine).borrow("b", prompt, 2)
    with pytest.raises(PeerPullUnsupported, match="prefix cach"):
        PrefixShare(plain.engine).lend("l", prompt, 0, 2)


def test_a_holder_lending_fewer_blocks_than_asked_publishes_only_those(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    holder, puller, reference = (make_llm(llama_dir) for _ in range(3))
    size = puller.engine.block_size
    prompt = list(range(500, 500 + 3 * size + 2))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    holder.generate([prompt[: 2 * size + 1]], SamplingParams(max_tokens=1))  # 2 of 3 blocks
    take, give = PrefixShare(puller.engine), PrefixShare(holder.engine)
    borrowed = take.borrow("b", prompt, 3)
    assert borrowed is not None and (borrowed.first_block, len(borrowed.block_ids)) == (0, 3)
    lent = give.lend("lease", prompt, 0, 3).block_ids
    assert len(lent) == 2  # the run it caches
    for layer in range(holder.engine.kv_layout.num_layers):
        puller.engine.kv_cache.write_layer(
            layer, borrowed.block_ids[:2], holder.engine.kv_cache.read_layer(layer, lent)
        )
    holder.engine.free_pinned("lease")
    with pytest.raises(ValueError, match="num_written"):
        take.landed("b", 4)
    free = puller.engine.block_manager.num_free_blocks
    assert len(take.landed("b", 2)) == 2
    assert puller.engine.block_manager.num_free_blocks == free + 1  # the unwritten one
    take.give_back("b")
    assert puller.generate([prompt], params)[0].token_ids == (
        reference.generate([prompt], params)[0].token_ids
    )
    assert puller.engine.stats().num_prompt_tokens_computed == size + 2


def test_a_holder_lends_a_prefix_its_host_tier_holds(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    # 24 device blocks of 8: three 64-token prompts of other tenants evict the first one.
    holder = make_llm(llama_dir, host_cache_gib=0.05, num_blocks=24, block_size=8)
    puller, reference = make_llm(llama_dir, block_size=8), make_llm(llama_dir, block_size=8)
    engine = holder.engine
    prompt = list(range(200, 200 + 6 * 8 + 3))  # 6 whole blocks, then 3 tokens
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    holder.generate([prompt], SamplingParams(max_tokens=1))
    for i in range(3):
        holder.generate([list(range(400 + 70 * i, 464 + 70 * i))], SamplingParams(max_tokens=1))
    give, take = PrefixShare(engine), PrefixShare(puller.engine)
    hashes = take._sequence("h", prompt, 6)
    assert hashes is not None
    device = engine.block_manager.find_cached_prefix(hashes.block_hashes, 6)
    assert len(device) < 6  # evicted from the device cache, at least in part
    borrowed = take.borrow("b", prompt, 6)
    assert borrowed is not None and len(borrowed.block_ids) == 6
    lent = give.lend("lease", prompt, 0, 6)
    assert len(lent.block_ids) == 6 and lent.num_from_host == 6 - len(device)
    assert lent.copy is not None
    lent.copy.result()  # lands before anything reads the blocks
    for layer in range(engine.kv_layout.num_layers):
        puller.engine.kv_cache.write_layer(
            layer, borrowed.block_ids, engine.kv_cache.read_layer(layer, lent.block_ids)
        )
    engine.free_pinned("lease")
    take.landed("b", 6)
    take.give_back("b")
    assert puller.generate([prompt], params)[0].token_ids == (
        reference.generate([prompt], params)[0].token_ids
    )
    assert puller.engine.stats().num_prompt_tokens_computed == 3
    engine.host_tier.index.check()  # type: ignore[union-attr]
