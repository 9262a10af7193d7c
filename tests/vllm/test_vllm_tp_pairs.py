"""Tensor-parallel KV transfer on the vLLM engine, real processes behind the router, over gRPC and
NIXL: a TP=1 prefill worker with a TP=2 decode worker (grpc), a TP=2 prefill worker with a TP=1
decode worker (nixl) and TP=1 with TP=1 (nixl) (the tiny llama's 2 KV heads: one per rank at
TP=2), and the tiny MoE TP=2 with TP=2 (grpc). The llama's TP=2 with TP=2 over NIXL is
``test_vllm_tensor_parallel.py``'s cluster (the same checks, with its leases and kills). At TP=2
vLLM's engine core runs in a process of its own (``--engine-core auto``). Each decode rank reads
the heads its shard holds from the prefill rank(s) that hold them (``engine/kv_shards.py``);
over NIXL each rank registers its own pages and reads straight into them, the handshake naming
where the shard lies in the sender's (``KVPages.spans``).

- Greedy and seeded streams equal the decode worker's own colocated run (the decode side's
  tensor parallelism computes every output token); with unequal TP the prefill side's other
  split changes the KV only by float rounding, so a difference is allowed only at a near-tie,
  and reported. Greedy also against vLLM's offline run at the decode side's TP.
- The decode pool computes no prompt token; every block of both workers comes back.
- A handle of a tensor parallelism the decode worker cannot map is refused by name.

vLLM's CPU build runs TP=2 here with the cores named (this box has one NUMA node): the local
cluster names them (``app/cpu_share.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from app.local_cluster import LocalCluster
from engine.sampling_params import SamplingParams
from pdserve.common.convert import sampling_to_proto
from pdserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.faults.faults_util import stats
from tests.services.harness import wait_for
from tests.vllm.conftest import BLOCK_SIZE, vllm_cluster
from tests.vllm.vllm_util import (
    blocks_back,
    colocated,
    offline_greedy,
    same_or_near_tie,
    through_router,
)

TP2 = ("--tensor-parallel-size", "2")
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(
    max_tokens=16, temperature=0.9, top_p=0.9, top_k=40, seed=11, ignore_eos=True, logprobs=2
)
PROMPTS = [[(29 * i + 13 * k) % 900 + 3 for i in range(n)] for k, n in enumerate((7, 70))]


@pytest.fixture(scope="module")
def cluster(
    request: pytest.FixtureRequest,
    vllm_model: Callable[[str], Path],
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LocalCluster]:
    """One cluster per pair of sizes, shared by the tests that name it."""
    prefill_tp, decode_tp, backend, arch = request.param
    # No VLLM_CPU_OMP_THREADS_BIND: the cluster gives each rank its cores (one NUMA node here,
    # where vLLM's own binding would refuse TP=2): 3 ranks on 2 cores, in turn.
    with vllm_cluster(
        vllm_model(arch),
        redis_url,
        tmp_path_factory.mktemp(f"vllm-{arch}-p{prefill_tp}-d{decode_tp}-{backend}"),
        prefill_args=("--kv-backend", backend, *(TP2 if prefill_tp == 2 else ())),
        decode_args=("--kv-backend", backend, *(TP2 if decode_tp == 2 else ())),
    ) as running:
        yield running


async def _idle(cluster: LocalCluster) -> None:
    async def idle() -> bool:
        for worker in (*cluster.prefill, *cluster.decode):
            s = await stats(worker)
            if (s.num_pinned, s.num_running, s.num_waiting, s.num_inflight) != (0, 0, 0, 0):
                return False
        return True

    await wait_for(idle, 60.0, "both workers idle")


# (prefill TP, decode TP, backend, model): the tiny llama; and the tiny MoE (its experts
# sharded by vLLM's TP too) TP=2 -> TP=2.
PAIRS = [
    (1, 2, "grpc", "llama"),
    (2, 1, "nixl", "llama"),
    (1, 1, "nixl", "llama"),
    (2, 2, "grpc", "qwen3_moe"),
]


@pytest.mark.parametrize(
    "cluster",
    PAIRS,
    ids=["p1-d2-grpc", "p2-d1-nixl", "p1-d1-nixl", "moe-p2-d2-grpc"],
    indirect=True,
)
def test_tensor_parallel_streams_equal_the_decode_workers_own_run(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefill, decode = cluster.prefill[0], cluster.decode[0]

    async def sizes() -> tuple[int, int]:
        return (await stats(prefill)).layout.tp_size, (await stats(decode)).layout.tp_size

    tp = asyncio.run(sizes())
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1" if tp[1] == 2 else "0-1")  # offline
    model = Path(cluster.config.model)
    offline = offline_greedy(model, PROMPTS, GREEDY.max_tokens, None, tp[1])

    async def run() -> list[str]:
        await _idle(cluster)
        free = [(await stats(w)).num_free_blocks for w in (prefill, decode)]
        computed = (await stats(decode)).num_prompt_tokens_computed
        served = {
            (i, name): await through_router(cluster.address, prompt, params)
            for i, prompt in enumerate(PROMPTS)
            for name, params in (("greedy", GREEDY), ("seeded", SEEDED))
        }
        assert (await stats(decode)).num_prompt_tokens_computed == computed
        reports = []
        for i, prompt in enumerate(PROMPTS):
            for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
                label = f"P TP={tp[0]} -> D TP={tp[1]}, {len(prompt)} tokens, {name}"
                got = served[i, name]
                assert len(got.token_ids) == params.max_tokens, label
                own = await colocated(decode.address, prompt, params, f"c{i}{name}")
                reports.append(same_or_near_tie(got, own, label))
            reports.append(same_or_near_tie(served[i, "greedy"], offline[i], "vLLM offline"))
        await _idle(cluster)
        for worker, count in zip((prefill, decode), free, strict=True):
            await blocks_back(worker, count, f"{worker.name} freed what it held")
        return [r for r in reports if r]

    print("\n".join(asyncio.run(run())))


@pytest.mark.parametrize("cluster", PAIRS[:1], ids=["p1-d2-grpc"], indirect=True)
def test_a_handle_of_a_tensor_parallelism_the_decode_worker_cannot_map_is_refused_by_name(
    cluster: LocalCluster,
) -> None:
    prefill, decode = cluster.prefill[0], cluster.decode[0]
    prompt = PROMPTS[1][: 2 * BLOCK_SIZE + 3]

    async def run() -> None:
        await _idle(cluster)
        free = (await stats(decode)).num_free_blocks
        async with grpc.aio.insecure_channel(prefill.address) as channel:
            request = prefill_pb2.PrefillRequest(
                request_id="tp3", prompt_token_ids=prompt, sampling=sampling_to_proto(GREEDY)
            )
            prefilled = await prefill_pb2_grpc.PrefillWorkerStub(channel).Prefill(request)
        handle = prefilled.lease
        handle.layout.tp_size = 3  # as if the prefill engine ran 3 ranks
        async with grpc.aio.insecure_channel(decode.address) as channel:
            request = decode_pb2.DecodeRequest(
                request_id="tp3",
                prompt_token_ids=prompt,
                sampling=sampling_to_proto(GREEDY),
                handle=handle,
                first_token_id=prefilled.first_token_id,
                prefill_address=prefill.address,
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in decode_pb2_grpc.DecodeWorkerStub(channel).Decode(request):
                    pass
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "tp_size 3 (prefill) and tp_size 2 (decode) do not divide" in (
            refused.value.details() or ""
        )
        await _idle(cluster)  # the prefill side's lease ended (released or expired)
        # vLLM's engine core frees the refused request's blocks after its stats last spoke.
        await blocks_back(decode, free, "the decode side freed what the refusal allocated")

    asyncio.run(run())
