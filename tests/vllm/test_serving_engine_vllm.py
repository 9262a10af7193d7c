"""The serving-engine contract (``tests/contract/serving_engine_suite.py``) on the vLLM engine,
built in this process as a worker builds it (one vLLM engine: its connector is per process)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from engine.config import CacheConfig, EngineBackend, EngineConfig, VllmOptions
from engine.serving_engine import EngineHooks
from tests.contract.serving_engine_suite import CASES, Case
from tests.vllm.conftest import BLOCK_SIZE
from vllm_engine.builder import build_vllm_engine
from vllm_engine.engine import VllmEngine


@pytest.fixture(scope="module")
def loop_and_engine(
    vllm_model: Callable[[str], Path],
) -> Iterator[tuple[asyncio.AbstractEventLoop, VllmEngine]]:
    config = EngineConfig(
        model=str(vllm_model("llama")),
        backend=EngineBackend.VLLM,
        max_model_len=512,
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=24),
        vllm=VllmOptions(enforce_eager=True),
    )

    async def started() -> VllmEngine:
        engine = await build_vllm_engine(config, EngineHooks())
        engine.start()
        return engine

    loop = asyncio.new_event_loop()
    engine = loop.run_until_complete(started())
    yield loop, engine
    loop.run_until_complete(engine.close())
    loop.close()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_vllm_engine_keeps_the_contract(
    case: Case, loop_and_engine: tuple[asyncio.AbstractEventLoop, VllmEngine]
) -> None:
    loop, engine = loop_and_engine
    assert engine.num_blocks == 24
    assert engine.kv_layout.page_layout.startswith("vllm-0.32.0/")
    loop.run_until_complete(case(engine, list(range(40, 110))))


def test_vllm_prompt_logprobs_are_hfs(
    loop_and_engine: tuple[asyncio.AbstractEventLoop, VllmEngine],
    vllm_model: Callable[[str], Path],
) -> None:
    """vLLM's own prompt logprobs, as pdserve passes them on: HF's log-softmax within 1e-4."""
    import torch

    from engine.sampling_params import SamplingParams
    from tests.contract.serving_engine_suite import collect
    from tests.engine.hf_reference import hf_logits, load_hf

    loop, engine = loop_and_engine
    prompt = [(31 * i + 7) % 900 + 3 for i in range(40)]
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    out = loop.run_until_complete(collect(engine.generate("hf", prompt, params)))
    logp = torch.log_softmax(hf_logits(load_hf(vllm_model("llama")), prompt), dim=-1)
    want = logp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    got = torch.tensor([e.logprob for e in out.prompt_logprobs])
    assert [e.token_id for e in out.prompt_logprobs] == prompt[1:]
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
