"""An engine whose waiting requests cannot get blocks reports an idle step (the async driver
then waits for a release instead of spinning)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from engine import SamplingParams
from native_engine import LLM


def test_step_is_idle_while_pinned_blocks_fill_the_cache(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    engine = make_llm(llama_dir, block_size=16, num_blocks=4).engine
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = engine.add_request(list(range(1, 60)), params, prefill_only=True)  # 4 blocks
    while first not in engine.pinned:
        engine.step()
    assert engine.block_manager.num_free_blocks == 0
    second = engine.add_request(list(range(1, 20)), params)
    assert engine.step() == []
    assert engine.last_step_idle
    engine.free_pinned(first)
    engine.step()
    assert not engine.last_step_idle
    while engine.has_unfinished_requests():
        engine.step()
    assert second not in engine.pinned
