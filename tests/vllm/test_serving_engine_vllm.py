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


def test_a_request_whose_grammar_runs_out_of_tokens_fails_alone(
    loop_and_engine: tuple[asyncio.AbstractEventLoop, VllmEngine],
    vllm_model: Callable[[str], Path],
) -> None:
    """vLLM behind pdserve's sampler: a position whose allowed tokens the request's bad_words
    all ban is that request's RequestError (its processor never raises inside vLLM's step),
    a first position already so, and ids past the vocabulary, are refused at admission; the
    engine serves the next request, and every block is back."""
    from engine.request_error import RequestError
    from engine.sampling_params import SamplingParams
    from engine.structured_output import StructuredKind, StructuredOutput
    from engine.tokenizer import Tokenizer
    from tests.contract.serving_engine_suite import collect, settled

    loop, engine = loop_and_engine
    tokenizer = Tokenizer.from_dir(vllm_model("llama"))
    assert tokenizer is not None
    (seven,), (eight,) = (tokenizer.encode(t, add_special_tokens=False) for t in ("7", "8"))
    prompt = list(range(40, 80))
    regex = StructuredOutput(StructuredKind.REGEX, "78", "guided_regex")
    later = SamplingParams(
        max_tokens=4, temperature=0.0, structured=regex, bad_words=[[seven, eight]]
    )
    with pytest.raises(RequestError, match=r"output index 1.*guided_regex.*bad_words"):
        loop.run_until_complete(collect(engine.generate("later", prompt, later)))
    first = SamplingParams(max_tokens=4, temperature=0.0, structured=regex, bad_words=[[seven]])
    with pytest.raises(ValueError, match="output index 0"):
        loop.run_until_complete(collect(engine.generate("first", prompt, first)))
    huge = SamplingParams(max_tokens=2, bad_words=[[3, 1 << 31]])
    with pytest.raises(ValueError, match="bad_words has ids outside the vocabulary"):
        loop.run_until_complete(collect(engine.generate("huge", prompt, huge)))
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = loop.run_until_complete(collect(engine.generate("next", prompt, plain)))
    assert len(out.token_ids) == 4 and engine.error is None
    loop.run_until_complete(settled(engine, engine.num_blocks))
