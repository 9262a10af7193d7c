"""vLLM's engine core in a process of its own (``--engine-core process``,
``vllm_engine/process_core.py``), with real processes: a prefill worker and two decode workers,
each a front-end driving its engine core through vLLM's ``AsyncLLM``, behind the router.

- Each worker is a front-end and an engine-core process named for it (``<worker> vllm engine
  core``), whose rank runs under it.
- Disaggregated greedy and seeded streams equal one such worker's colocated run; the decode
  pool computes no prompt token.
- A client cancel before the first token and mid-decode frees every block (the orderings an
  engine core in another process adds: a pin after its output, an allocation after a cancel).
- kill -9 of a decode worker's engine core mid-stream: the worker leaves the pool, every
  stream completes identical; kill -9 of a front-end: its engine core and rank exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from app.local_cluster import Component, LocalCluster
from engine.sampling_params import SamplingParams
from tests.faults.faults_util import (
    kill_the_busiest_decode_worker,
    mixed_params,
    restarted,
    stats,
    survivors_hold_nothing,
)
from tests.services.harness import wait_for
from tests.vllm.conftest import BLOCK_SIZE, WORKER_ARGS, vllm_cluster
from tests.vllm.vllm_util import cancel_at_each_stage, colocated, gone, through_router

PROCESS = ("--engine-core", "process")
MAX_MODEL_LEN = int(WORKER_ARGS[WORKER_ARGS.index("--max-model-len") + 1])
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(
    max_tokens=16, temperature=0.9, top_p=0.9, top_k=40, seed=11, ignore_eos=True, logprobs=2
)


def _prompt(length: int, salt: int = 0) -> list[int]:
    return [(29 * i + 89 * salt) % 900 + 3 for i in range(length)]


@pytest.fixture(scope="module")
def cluster(
    vllm_model: Callable[[str], Path], redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    with vllm_cluster(
        vllm_model("llama"),
        redis_url,
        tmp_path_factory.mktemp("vllm-core"),
        num_decode=2,
        prefill_args=PROCESS,
        decode_args=PROCESS,
    ) as running:
        yield running


def _engine_core(component: Component) -> tuple[psutil.Process, list[psutil.Process]]:
    """A worker's engine-core process and every vLLM process of it (the core and its ranks)."""
    front = psutil.Process(component.process.pid)
    title = " ".join(front.cmdline()).strip()
    cores, ours = [], []
    for child in front.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            command = " ".join(child.cmdline()).strip()
            if command == f"{title} vllm engine core":
                cores.append(child)
            if command.startswith(f"{title} vllm "):
                ours.append(child)
    assert title.startswith("pdserve ") and len(cores) == 1, (title, cores)
    return cores[0], ours


def test_each_worker_is_a_front_end_and_its_engine_core_process(cluster: LocalCluster) -> None:
    for component in (*cluster.prefill, *cluster.decode):
        core, ours = _engine_core(component)
        assert core.ppid() == component.process.pid
        ranks = [p for p in ours if p is not core]
        assert [r.ppid() for r in ranks] in ([], [core.pid]), ranks  # its rank, if apart


def test_disaggregated_streams_equal_one_worker_colocated(cluster: LocalCluster) -> None:
    prompts = [_prompt(n, salt) for salt, n in enumerate((7, BLOCK_SIZE + 3, 2 * BLOCK_SIZE))]

    async def run() -> None:
        decode_before = [(await stats(c)).num_prompt_tokens_computed for c in cluster.decode]
        for i, prompt in enumerate(prompts):
            for params in (GREEDY, SEEDED):
                served = await through_router(cluster.address, prompt, params)
                ref = await colocated(cluster.decode[0].address, prompt, params, f"c{i}")
                assert served.token_ids == ref.token_ids, (i, params.temperature)
        decode_after = [(await stats(c)).num_prompt_tokens_computed for c in cluster.decode]
        colocated_tokens = sum(len(p) for p in prompts) * 2
        # Only the colocated references computed prompts on the decode pool.
        assert sum(decode_after) - sum(decode_before) <= colocated_tokens
        await wait_for(lambda: survivors_hold_nothing(cluster), 60.0, "every block back")

    asyncio.run(run())


def test_a_cancel_before_the_first_token_and_mid_decode_frees_every_block(
    cluster: LocalCluster,
) -> None:
    asyncio.run(cancel_at_each_stage(cluster, _prompt(120, 70)))


def test_a_request_vllm_refuses_fails_alone_by_name(cluster: LocalCluster) -> None:
    """A prompt of max_model_len tokens passes pdserve's admission but not vLLM's (it wants a
    position for the output): that request fails with INVALID_ARGUMENT naming vLLM's refusal,
    and the engine core and its worker go on."""
    decode = cluster.decode[0]
    full = _prompt(MAX_MODEL_LEN, 90)

    async def run() -> None:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await colocated(decode.address, full, GREEDY, "full")
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT, refused.value
        assert "vLLM refused request 'full'" in (refused.value.details() or "")
        after = await colocated(decode.address, _prompt(9, 91), GREEDY, "after")
        assert len(after.token_ids) == GREEDY.max_tokens
        assert decode.process.poll() is None
        await wait_for(lambda: survivors_hold_nothing(cluster), 60.0, "nothing held")

    asyncio.run(run())


def test_kill_9_of_an_engine_core_mid_stream_loses_no_stream(cluster: LocalCluster) -> None:
    prompts = [_prompt(30 + 9 * i, 50 + i) for i in range(4)]
    params = mixed_params(len(prompts), max_tokens=80)  # stream 3 guided

    async def run() -> None:
        references = [
            await colocated(cluster.decode[i % 2].address, prompt, p, f"ref{i}")
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))
        ]

        def kill_the_engine_core(victim: Component) -> None:
            _engine_core(victim)[0].send_signal(signal.SIGKILL)  # not the front-end

        streams, victim = await kill_the_busiest_decode_worker(
            cluster, prompts, params, 180.0, kill=kill_the_engine_core
        )
        assert victim.process.returncode not in (None, 0)  # its engine died with the core
        for i, (stream, ref) in enumerate(zip(streams, references, strict=True)):
            assert stream.token_ids == ref.token_ids, f"stream {i}"

    asyncio.run(run())


def test_kill_9_of_a_front_end_leaves_none_of_its_vllm_processes(cluster: LocalCluster) -> None:
    prefill = cluster.prefill[0]
    _, ours = _engine_core(prefill)

    async def run() -> None:
        prefill.process.send_signal(signal.SIGKILL)

        async def orphans_gone() -> bool:
            return all(gone(p) for p in ours)

        await wait_for(orphans_gone, 60.0, "the killed front-end's engine core and rank exited")
        await wait_for(lambda: restarted(cluster, prefill), 180.0, "the prefill worker restarted")

    asyncio.run(run())
