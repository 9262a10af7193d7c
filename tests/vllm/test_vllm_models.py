"""Models the native engine cannot serve, served end to end on the vLLM engine through
``pdserve up --engine vllm``: tiny random Qwen3-MoE (disaggregated) and Mixtral (colocated), and
the real SmolLM2 chat model answering the official ``openai`` client."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from engine.sampling_params import SamplingParams
from tests.vllm.conftest import vllm_cluster
from tests.vllm.vllm_util import colocated, offline_greedy, same_or_near_tie, through_router

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True)
PROMPTS = [[(13 * i + 7 * k) % 1000 + 3 for i in range(n)] for k, n in enumerate((9, 40, 75))]


def test_qwen3_moe_disaggregated_equals_one_worker_and_vllms_offline_run(
    vllm_model: Callable[[str], Path], redis_url: str, tmp_path: Path
) -> None:
    model = vllm_model("qwen3_moe")
    offline = offline_greedy(model, PROMPTS, GREEDY.max_tokens)
    with vllm_cluster(model, redis_url, tmp_path) as cluster:

        async def run() -> list[str]:
            reports = []
            for i, prompt in enumerate(PROMPTS):
                for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
                    got = await through_router(cluster.address, prompt, params)
                    one = await colocated(cluster.decode[0].address, prompt, params, f"{i}{name}")
                    assert len(got.token_ids) == params.max_tokens
                    if (report := same_or_near_tie(got, one, f"{i} {name}")) is not None:
                        reports.append(report)
                    if name == "greedy":
                        report = same_or_near_tie(got, offline[i], f"{i} offline")
                        if report is not None:
                            reports.append(report)
            return reports

        print("\n".join(asyncio.run(run())))


def test_mixtral_serves_through_pdserve_up_as_vllms_offline_run(
    vllm_model: Callable[[str], Path], redis_url: str, tmp_path: Path
) -> None:
    model = vllm_model("mixtral")
    offline = offline_greedy(model, PROMPTS, GREEDY.max_tokens)
    with vllm_cluster(model, redis_url, tmp_path, colocated=True) as cluster:

        async def run() -> list[str | None]:
            return [
                same_or_near_tie(
                    await through_router(cluster.address, prompt, GREEDY), ref, f"prompt {i}"
                )
                for i, (prompt, ref) in enumerate(zip(PROMPTS, offline, strict=True))
            ]

        print("\n".join(r for r in asyncio.run(run()) if r))


@pytest.mark.slow
def test_the_real_chat_model_answers_the_openai_client_disaggregated(
    chat_model_dir: Path, redis_url: str, tmp_path: Path
) -> None:
    question = [{"role": "user", "content": "What is the capital of France?"}]
    with vllm_cluster(chat_model_dir, redis_url, tmp_path, http=True) as cluster:
        client = openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused")
        reply = client.chat.completions.create(
            model=str(chat_model_dir), messages=question, max_tokens=24, temperature=0
        )  # type: ignore[call-overload]
        answer = reply.choices[0].message.content or ""
        assert "Paris" in answer, answer
        chunks = client.chat.completions.create(
            model=str(chat_model_dir),
            messages=question,
            max_tokens=24,
            temperature=0,
            stream=True,
        )  # type: ignore[call-overload]
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == answer
        prompt = reply.usage.prompt_tokens if reply.usage else 0
        assert prompt > 20  # long enough to be disaggregated (the cluster always is)


def test_pdserve_profile_measures_a_vllm_worker(
    vllm_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """The planner's profile, measured on the vLLM engine through the serving contract."""
    import subprocess
    import sys

    from app.capacity import profile as profile_io

    out = tmp_path / "profile.json"
    flags = "--engine vllm --enforce-eager --quick --num-blocks 64"  # its default block size
    command = [sys.executable, "-m", "app", "profile", "--model", str(vllm_model("llama"))]
    command += [*flags.split(), "--max-num-seqs", "4", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    profile = profile_io.load(out)
    assert profile.hardware["engine"] == "vllm" and profile.model_fingerprint.endswith(":vllm")
    assert profile.num_blocks == 64 and profile.block_size == 32
    assert profile.prefill.num_samples >= 4 and profile.decode.num_samples >= 4
    assert profile.transfer.num_samples == 2 and profile.transfer_s(1 << 20) > 0
