"""The host-memory KV tier: with a device cache too small for a multi-turn working set, the
second turn loads its evicted prefixes from the host tier instead of recomputing them, gives
the tokens a run without the tier gives, and leaves no block held in either pool."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import SamplingParams
from native_engine import LLM
from tests.identical import compare_outputs

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SMALL_CACHE = {"num_blocks": 24, "block_size": 8}  # 192 tokens: one turn is 6 x 56


def _conversations(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1024) for _ in range(48)] for _ in range(6)]


def _two_turns(llm: LLM, firsts: list[list[int]]) -> tuple[list, list]:
    one = llm.generate(firsts, PARAMS)
    rng = random.Random(1)
    seconds = [
        p + o.token_ids + [rng.randrange(3, 1024) for _ in range(8)]
        for p, o in zip(firsts, one, strict=True)
    ]
    return one, llm.generate(seconds, PARAMS)


def test_a_second_turn_loads_evicted_prefixes_from_the_host_tier(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    firsts = _conversations(0)
    plain = make_llm(llama_dir, **SMALL_CACHE)
    tiered = make_llm(llama_dir, host_cache_gib=0.05, **SMALL_CACHE)
    plain_one, plain_two = _two_turns(plain, firsts)
    tier_one, tier_two = _two_turns(tiered, firsts)
    assert not compare_outputs(plain, tier_one + tier_two, plain_one + plain_two, [PARAMS] * 12)
    with_tier, without = tiered.engine.stats(), plain.engine.stats()
    assert with_tier.num_host_hit_tokens > 0 and without.num_host_hit_tokens == 0
    assert with_tier.num_prompt_tokens_computed < without.num_prompt_tokens_computed
    # num_cached_tokens counts both tiers, request by request.
    assert sum(o.num_cached_tokens for o in tier_two) > sum(o.num_cached_tokens for o in plain_two)
    assert with_tier.num_prefix_hit_tokens >= with_tier.num_host_hit_tokens
    # Every host hit was a block copied out, then back in.
    assert with_tier.num_host_stored_blocks >= with_tier.num_host_loaded_blocks > 0
    # (a request preempted and readmitted may load again; its hits count once)
    assert with_tier.num_host_loaded_blocks * 8 >= with_tier.num_host_hit_tokens
    assert not tiered.engine.host_loads.loading and with_tier.num_host_cached_blocks > 0
    tiered.engine.host_tier.index.check()  # every host slot held once or free


def test_an_aborted_load_frees_its_blocks_once_the_copy_lands(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(llama_dir, host_cache_gib=0.05, **SMALL_CACHE)
    firsts = _conversations(2)
    llm.generate(firsts, PARAMS)
    llm.generate(_conversations(3), PARAMS)  # evicts the first turn from the device cache
    engine = llm.engine
    ids = [engine.add_request(p, PARAMS) for p in firsts]
    engine.step()
    loading = [i for i in ids if i in engine.host_loads.loading]
    assert loading, "some first-turn prompt should be loading from the host tier"
    for request_id in ids:
        engine.abort(request_id)  # never waits for a copy (it may run on an event loop)
    assert not engine.host_loads.loading
    while engine.has_unfinished_requests():  # the aborted loads land, then their blocks go
        assert not engine.step()
    assert not engine.host_loads.abandoned


def test_the_host_tier_needs_prefix_caching(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="host_cache_gib"):
        LLM(str(llama_dir), host_cache_gib=1.0, enable_prefix_caching=False)


def test_a_host_pool_about_the_device_caches_size_still_gives_the_same_tokens(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    """Few host slots, constant evictions from both pools: stores queued ahead of a load must
    not take the slots it reads (else it copies another block's bytes and tokens differ)."""
    plain = make_llm(llama_dir, **SMALL_CACHE)
    block_bytes = plain.engine.kv_layout.block_bytes
    tiered = make_llm(llama_dir, host_cache_gib=28 * block_bytes / 2**30, **SMALL_CACHE)
    assert tiered.engine.stats().num_host_blocks == 28  # barely more than the device's 24
    for seed in (0, 4):
        firsts = _conversations(seed)
        plain_turns, tier_turns = _two_turns(plain, firsts), _two_turns(tiered, firsts)
        assert not compare_outputs(plain, [*tier_turns[0], *tier_turns[1]],
                                   [*plain_turns[0], *plain_turns[1]], [PARAMS] * 12)  # fmt: skip
    assert tiered.engine.stats().num_host_hit_tokens > 0
    assert tiered.engine.host_tier is not None
    tiered.engine.host_tier.index.check()


def test_the_host_tier_and_a_draft_model_together(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    firsts = _conversations(5)
    reference = _two_turns(make_llm(llama_dir, **SMALL_CACHE), firsts)
    both = make_llm(
        llama_dir, host_cache_gib=0.05, speculative_method="draft",
        spec_draft_model=str(llama_dir), **SMALL_CACHE,
    )  # fmt: skip
    got = _two_turns(both, firsts)
    assert not compare_outputs(
        both, [*got[0], *got[1]], [*reference[0], *reference[1]], [PARAMS] * 12
    )
    stats = both.engine.stats()
    assert stats.num_host_hit_tokens > 0 and stats.num_spec_accepted_tokens > 0
