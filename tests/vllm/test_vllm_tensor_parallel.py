"""Tensor-parallel disaggregation on the vLLM engine, with real processes: a TP=2 vLLM prefill
worker and two TP=2 vLLM decode workers over NIXL, behind the router. Each worker is a front-end,
vLLM's engine core in a process of its own (the default with tensor parallelism) and two rank
processes under it; each decode rank registers its own pages and reads its own shard from the
same prefill rank (``vllm_engine/rank_transfer.py``). TP=2 to TP=2 over gRPC is the MoE pair in
``test_vllm_tp_pairs.py``.

- Greedy and seeded streams equal one TP=2 vLLM worker run colocated; greedy equals vLLM's own
  offline TP=2 run (near-ties reported apart); the decode pool computes no prompt token.
- Leases across ranks: after Release, expiry and a Release before the pull (NOT_FOUND, by name),
  every block of both workers is back (vLLM frees only once every rank reported).
- kill -9 of one rank process of a decode worker mid-stream: that worker leaves the pool (its
  engine dies), every stream completes identical; kill -9 of a worker's front-end: none of its
  rank processes is left.

vLLM's CPU build runs TP=2 here with the cores named (this box has one NUMA node).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from app.local_cluster import Component, LocalCluster
from engine.sampling_params import SamplingParams
from pdserve.common.convert import sampling_to_proto
from pdserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.faults.faults_util import (
    kill_the_busiest_decode_worker,
    mixed_params,
    restarted,
    stats,
)
from tests.services.harness import wait_for
from tests.vllm.conftest import BLOCK_SIZE, vllm_cluster
from tests.vllm.vllm_util import (
    blocks_back,
    colocated,
    gone,
    idle_free_blocks,
    offline_greedy,
    same_or_near_tie,
    through_router,
)

TP2 = ("--tensor-parallel-size", "2")
NIXL = ("--kv-backend", "nixl")
LEASE_S = 15.0
LENGTHS = (5, BLOCK_SIZE + 1, 3 * BLOCK_SIZE + 7)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(
    max_tokens=16, temperature=0.9, top_p=0.9, top_k=40, seed=7, ignore_eos=True, logprobs=2
)


def _prompt(length: int, salt: int = 0) -> list[int]:
    return [(23 * i + 97 * salt) % 900 + 3 for i in range(length)]


@pytest.fixture(scope="module")
def bound_cores() -> Iterator[None]:
    before = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per rank, on every worker
    yield
    if before is None:
        del os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    else:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = before


@pytest.fixture(scope="module")
def cluster(
    vllm_model: Callable[[str], Path],
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
    bound_cores: None,
) -> Iterator[LocalCluster]:
    with vllm_cluster(
        vllm_model("llama"),
        redis_url,
        tmp_path_factory.mktemp("vllm-tp2"),
        num_decode=2,
        prefill_args=(*TP2, *NIXL, "--lease-s", str(LEASE_S)),
        decode_args=(*TP2, *NIXL),
    ) as running:
        yield running


def test_tp2_to_tp2_streams_equal_one_tp2_worker_and_vllms_offline_tp2_run(
    cluster: LocalCluster, vllm_model: Callable[[str], Path]
) -> None:
    prompts = [_prompt(n, salt) for salt, n in enumerate(LENGTHS)]
    offline = offline_greedy(vllm_model("llama"), prompts, GREEDY.max_tokens, None, 2)
    prefill, decode = cluster.prefill[0], cluster.decode[0]

    async def run() -> list[str]:
        assert (await stats(prefill)).layout.tp_size == 2
        free = [await idle_free_blocks(prefill), await idle_free_blocks(decode)]
        decode_before = (await stats(decode)).num_prompt_tokens_computed
        served = {
            (i, name): await through_router(cluster.address, prompt, params)
            for i, prompt in enumerate(prompts)
            for name, params in (("greedy", GREEDY), ("seeded", SEEDED))
        }
        assert (await stats(decode)).num_prompt_tokens_computed == decode_before
        reports = []
        for i, prompt in enumerate(prompts):
            for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
                label = f"prompt of {len(prompt)} tokens, {name}"
                got = served[i, name]
                assert len(got.token_ids) == params.max_tokens, label
                one = await colocated(decode.address, prompt, params, f"c{i}{name}")
                if (report := same_or_near_tie(got, one, label)) is not None:
                    reports.append(report)
            report = same_or_near_tie(served[i, "greedy"], offline[i], "offline TP=2 greedy")
            if report is not None:
                reports.append(report)
        # Every rank reported every lease's end: vLLM freed each block on both workers.
        await blocks_back(prefill, free[0], "prefill blocks back")
        await blocks_back(decode, free[1], "decode blocks back")
        return reports

    print("\n".join(asyncio.run(run())))


def test_tp2_leases_release_expire_and_a_release_before_the_pull_is_not_found(
    cluster: LocalCluster,
) -> None:
    prefill, decode = cluster.prefill[0], cluster.decode[0]
    prompt = _prompt(2 * BLOCK_SIZE + 3, salt=9)

    async def run() -> None:
        free = [await idle_free_blocks(prefill), await idle_free_blocks(decode)]
        async with grpc.aio.insecure_channel(prefill.address) as channel:
            stub = prefill_pb2_grpc.PrefillWorkerStub(channel)

            async def prefill_one(rid: str) -> prefill_pb2.PrefillResponse:
                request = prefill_pb2.PrefillRequest(
                    request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_proto(GREEDY)
                )
                return await stub.Prefill(request, timeout=120)

            # Expiry: nobody pulls or releases; the lease ends by itself and every rank frees.
            await prefill_one("expires")
            assert (await stats(prefill)).num_pinned == 1
            await blocks_back(prefill, free[0], "an expired lease's blocks back on every rank")
            # A Release before the pull: the decode worker's pull is NOT_FOUND, by name.
            released = await prefill_one("released")
            await stub.Release(
                prefill_pb2.ReleaseRequest(
                    request_id="released", lease_token=released.lease.lease_token
                ),
                timeout=30,
            )
            await blocks_back(prefill, free[0], "a released lease's blocks back")
        async with grpc.aio.insecure_channel(decode.address) as channel:
            request = decode_pb2.DecodeRequest(
                request_id="released",
                prompt_token_ids=prompt,
                sampling=sampling_to_proto(GREEDY),
                handle=released.lease,
                first_token_id=released.first_token_id,
                prefill_address=prefill.address,
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in decode_pb2_grpc.DecodeWorkerStub(channel).Decode(request):
                    pass
        assert refused.value.code() is grpc.StatusCode.NOT_FOUND, refused.value.details()
        assert "no lease for request_id 'released'" in (refused.value.details() or "")
        await blocks_back(decode, free[1], "the failed pull's blocks back on every decode rank")

    asyncio.run(run())


def _ranks(pid: int) -> list[psutil.Process]:
    """A worker's vLLM rank processes, in rank order: each named ``<the worker's name> vllm
    rank <r>`` (``pdserve decode-0-3f9a1c vllm rank 1``) in ps, top and py-spy."""
    title = " ".join(psutil.Process(pid).cmdline()).strip()
    found = {}
    for child in psutil.Process(pid).children(recursive=True):
        try:
            command = " ".join(child.cmdline()).strip()
        except psutil.NoSuchProcess:
            continue
        if command.startswith(f"{title} vllm rank "):
            found[int(command.rsplit(" ", 1)[1])] = child
    assert title.startswith("pdserve ") and sorted(found) in ([], [0, 1]), (title, found)
    return [found[r] for r in sorted(found)]


def test_kill_9_of_one_decode_rank_mid_stream_loses_no_stream(cluster: LocalCluster) -> None:
    prompts = [_prompt(30 + 11 * i, 40 + i) for i in range(4)]
    params = mixed_params(len(prompts), max_tokens=80)  # stream 3 guided

    async def run() -> None:
        references = [
            await colocated(cluster.decode[i % 2].address, prompt, p, f"ref{i}")
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))
        ]

        def kill_a_rank(victim: Component) -> None:
            ranks = _ranks(victim.process.pid)
            assert len(ranks) == 2, ranks
            ranks[1].send_signal(signal.SIGKILL)  # not the front-end: one rank of its engine

        streams, victim = await kill_the_busiest_decode_worker(
            cluster, prompts, params, 180.0, kill=kill_a_rank
        )
        # Its engine died with the rank: the worker left the pool, and came back (restarted).
        assert victim.process.returncode not in (None, 0)
        for i, (stream, ref) in enumerate(zip(streams, references, strict=True)):
            assert stream.token_ids == ref.token_ids, f"stream {i}"

    asyncio.run(run())


def test_kill_9_of_a_front_end_leaves_none_of_its_rank_processes(cluster: LocalCluster) -> None:
    prefill = cluster.prefill[0]
    ranks = _ranks(prefill.process.pid)
    assert len(ranks) == 2, ranks

    async def run() -> None:
        prefill.process.send_signal(signal.SIGKILL)

        async def orphans_gone() -> bool:
            return all(gone(r) for r in ranks)

        await wait_for(orphans_gone, 60.0, "the killed front-end's ranks exited")
        await wait_for(lambda: restarted(cluster, prefill), 180.0, "the prefill worker restarted")

    asyncio.run(run())
