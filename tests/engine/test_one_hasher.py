"""One hasher end to end: the keys the router computes for a prompt (from the checkpoint
directory alone) are exactly the block hashes the engine publishes for that prompt."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

from engine import SamplingParams
from engine.block_hash import hash_blocks, root_hash
from engine.fingerprint import fingerprint_of
from native_engine import LLM


def test_router_hashes_equal_engine_kv_events(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    engine = make_llm(llama_dir, block_size=16, num_blocks=256).engine
    router_root = root_hash(fingerprint_of(llama_dir, "float32", 16))
    rng = random.Random(11)
    for length in [1, 15, 16, 17, 31, 32, 33, *rng.sample(range(34, 300), 8)]:
        prompt = [rng.randrange(3, 1024) for _ in range(length)]
        engine.block_manager.reset_prefix_cache()
        engine.block_manager.kv_events.drain()
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        while engine.has_unfinished_requests():
            engine.step()
        published = engine.block_manager.kv_events.drain().stored
        assert published == hash_blocks(router_root, prompt, 16), length
