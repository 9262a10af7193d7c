"""Disaggregated serving on the vLLM engine, with real processes: a vLLM prefill worker and two
vLLM decode workers over gRPC, behind the router (``pdserve up --engine vllm``).

- Greedy and seeded streams equal one vLLM worker run colocated, for prompts shorter than,
  equal to, one past and several blocks; greedy ones equal vLLM's own offline run too.
- Leases: Release, expiry and client cancels give every block back (vLLM's free-block count
  to its baseline); a Release before the pull fails the pull NOT_FOUND, by name.
- A native worker and a vLLM worker refuse each other's blocks by name, both directions.
- The prefix index hears of vLLM's cached blocks by pdserve's hashes; a repeat hits them.
- Requests written to break a worker (a grammar whose tokens its bad_words ban, ids past the
  vocabulary) are named INVALID_ARGUMENTs, and no worker dies.
- kill -9 of a decode worker mid-stream: every stream completes, identical (last: it restarts
  a worker).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from app.local_cluster import LocalCluster
from engine.block_hash import hash_blocks, root_hash
from engine.config import EngineBackend
from engine.fingerprint import engine_fingerprint
from engine.model_layout import ModelLayout
from engine.sampling_params import SamplingParams
from native_engine.builder import build_native_engine
from pdserve.cluster.redis_prefix_index import RedisPrefixIndex
from pdserve.common.convert import sampling_to_proto
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.faults.faults_util import (
    kill_the_busiest_decode_worker,
    mixed_params,
    stats,
)
from tests.services.harness import engine_config, failed_decode, start, wait_for
from tests.vllm.conftest import BLOCK_SIZE, WORKER_ARGS, vllm_cluster
from tests.vllm.vllm_util import (
    blocks_back,
    cancel_at_each_stage,
    colocated,
    idle_free_blocks,
    offline_greedy,
    same_or_near_tie,
    through_router,
)

MAX_MODEL_LEN = int(WORKER_ARGS[WORKER_ARGS.index("--max-model-len") + 1])
LEASE_S = 15.0  # expiry is tested; the router releases every lease it uses within ms
# Shorter than, equal to, one past, and several blocks.
LENGTHS = (5, BLOCK_SIZE, BLOCK_SIZE + 1, 3 * BLOCK_SIZE + 7)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(
    max_tokens=24, temperature=0.9, top_p=0.9, top_k=40, seed=7, ignore_eos=True, logprobs=2
)
# pdserve's logit processing (in pdserve's sampler inside vLLM) against vLLM's own.
PENALTIES = {
    "presence_penalty": 0.5,
    "frequency_penalty": 0.4,
    "repetition_penalty": 1.3,
    "logit_bias": {5: 2.0, 9: -3.0},
}
PENALIZED = dataclasses.replace(GREEDY, **PENALTIES)  # type: ignore[arg-type]
VARIANTS = (("greedy", GREEDY), ("seeded", SEEDED), ("penalized", PENALIZED))


def _prompt(length: int, salt: int = 0) -> list[int]:
    return [(17 * i + 101 * salt) % 900 + 3 for i in range(length)]


@pytest.fixture(scope="module")
def cluster(
    vllm_model: Callable[[str], Path], redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    with vllm_cluster(
        vllm_model("llama"),
        redis_url,
        tmp_path_factory.mktemp("vllm-pd"),
        num_decode=2,
        prefill_args=("--lease-s", str(LEASE_S)),
    ) as running:
        yield running


def test_disaggregated_streams_equal_one_vllm_worker_and_vllms_offline_run(
    cluster: LocalCluster, vllm_model: Callable[[str], Path]
) -> None:
    prompts = [_prompt(n, salt) for salt, n in enumerate(LENGTHS)]
    offline = offline_greedy(vllm_model("llama"), prompts, GREEDY.max_tokens)
    offline_penalized = offline_greedy(vllm_model("llama"), prompts, GREEDY.max_tokens, PENALTIES)

    async def run() -> list[str]:
        reports = []
        prefill_before = (await stats(cluster.prefill[0])).num_prompt_tokens_computed
        decode_before = [(await stats(c)).num_prompt_tokens_computed for c in cluster.decode]
        served = {}
        for i, prompt in enumerate(prompts):
            for name, params in VARIANTS:
                served[i, name] = await through_router(cluster.address, prompt, params)
        # The decode pool computed no prompt token: every prompt came from the prefill worker.
        decode_after = [(await stats(c)).num_prompt_tokens_computed for c in cluster.decode]
        assert decode_after == decode_before
        prefill_after = (await stats(cluster.prefill[0])).num_prompt_tokens_computed
        assert prefill_after - prefill_before >= sum(LENGTHS)
        for i, prompt in enumerate(prompts):
            for name, params in VARIANTS:
                label = f"prompt of {len(prompt)} tokens, {name}"
                got = served[i, name]
                assert got.finish_reason == "length" and len(got.token_ids) == params.max_tokens
                one = await colocated(cluster.decode[i % 2].address, prompt, params, f"c{i}{name}")
                if (report := same_or_near_tie(got, one, label)) is not None:
                    reports.append(report)
                elif name == "greedy":
                    assert got.margins == pytest.approx(one.margins, abs=1e-4), label
            for name, reference in (("greedy", offline), ("penalized", offline_penalized)):
                report = same_or_near_tie(served[i, name], reference[i], f"offline {name}")
                if report is not None:
                    reports.append(report)
            assert served[i, "penalized"].token_ids != served[i, "greedy"].token_ids
        return reports

    print("\n".join(asyncio.run(run())))


def _prefill_stub(channel: grpc.aio.Channel) -> prefill_pb2_grpc.PrefillWorkerStub:
    return prefill_pb2_grpc.PrefillWorkerStub(channel)


def test_leases_release_and_expire_and_a_release_before_the_pull_is_not_found(
    cluster: LocalCluster,
) -> None:
    prefill, decode = cluster.prefill[0], cluster.decode[0]
    sampling = sampling_to_proto(GREEDY)

    async def run() -> None:
        free_p, free_d = await idle_free_blocks(prefill), await idle_free_blocks(decode)
        async with grpc.aio.insecure_channel(prefill.address) as channel:
            stub = _prefill_stub(channel)

            async def prefilled(rid: str, salt: int) -> prefill_pb2.PrefillResponse:
                request = prefill_pb2.PrefillRequest(
                    request_id=rid, prompt_token_ids=_prompt(90, salt), sampling=sampling
                )
                response = await stub.Prefill(request, timeout=60)
                assert (await stats(prefill)).num_pinned == 1
                return response

            # Released: the blocks go back at once.
            first = await prefilled("released", 50)
            release = prefill_pb2.ReleaseRequest(
                request_id="released", lease_token=first.lease.lease_token
            )
            assert (await stub.Release(release, timeout=30)).released
            await blocks_back(prefill, free_p, "released blocks free")
            # Never pulled: they go back when the lease expires.
            await prefilled("expired", 51)
            await blocks_back(prefill, free_p, "expired lease's blocks free")
            # Released before the pull: the pull fails NOT_FOUND, and the decode side frees.
            early = await prefilled("early", 52)
            release = prefill_pb2.ReleaseRequest(
                request_id="early", lease_token=early.lease.lease_token
            )
            await stub.Release(release, timeout=30)
        request = decode_pb2.DecodeRequest(
            request_id="early",
            prompt_token_ids=_prompt(90, 52),
            sampling=sampling,
            first_token_id=early.first_token_id,
            handle=early.lease,
            prefill_address=prefill.address,
        )
        async with grpc.aio.insecure_channel(decode.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                async for _ in decode_pb2_grpc.DecodeWorkerStub(channel).Decode(request):
                    pass
        assert failed.value.code() is grpc.StatusCode.NOT_FOUND
        assert "no lease for request_id 'early'" in (failed.value.details() or "")
        await blocks_back(decode, free_d, "the decode side freed what it allocated")
        await blocks_back(prefill, free_p, "nothing left on the prefill side")

    asyncio.run(run())


def test_client_cancels_at_each_stage_free_every_block(cluster: LocalCluster) -> None:
    asyncio.run(cancel_at_each_stage(cluster, _prompt(120, 60)))


def test_native_and_vllm_workers_refuse_each_others_blocks_by_name(
    cluster: LocalCluster, vllm_model: Callable[[str], Path], redis_url: str
) -> None:
    """Same checkpoint, same block size: only the engine differs, and the layouts say so.
    (``failed_decode`` takes anything with an address: in-process servers, cluster workers.)"""
    from decode_service.config import DecodeConfig
    from decode_service.service import DecodeService
    from pdserve.cluster.config import RedisConfig
    from prefill_service.config import PrefillConfig
    from prefill_service.service import PrefillService

    model = vllm_model("llama")
    native = engine_config(model, block_size=BLOCK_SIZE, num_blocks=64)
    prompt = _prompt(70, 80)

    async def run() -> None:
        vllm_prefill, vllm_decode = cluster.prefill[0], cluster.decode[1]
        free_p, free_d = await idle_free_blocks(vllm_prefill), await idle_free_blocks(vllm_decode)
        # A native prefill worker in the cluster's registry (the router refuses it: another
        # fingerprint), so that the vLLM decode worker knows it as a peer.
        registry = RedisConfig(url=redis_url, namespace=cluster.config.redis_namespace)
        native_prefill = await start(
            PrefillService(
                PrefillConfig(engine=native, redis=registry, lease_s=5.0), build_native_engine
            )
        )
        native_decode = await start(
            DecodeService(
                DecodeConfig(engine=native, prefill_peers=(vllm_prefill.address,)),
                build_native_engine,
            )
        )
        try:
            unknown = grpc.StatusCode.PERMISSION_DENIED  # until the registry names the peer
            attempts = iter(range(1000))
            async with asyncio.timeout(60):
                while (
                    first := await failed_decode(
                        native_prefill, vllm_decode, prompt, GREEDY, f"x{next(attempts)}"
                    )
                ).code() is unknown:
                    await asyncio.sleep(0.5)
            back = await failed_decode(vllm_prefill, native_decode, prompt, GREEDY, "y")
            for error, pair in ((first, "native -> vllm"), (back, "vllm -> native")):
                details = error.details() or ""
                assert error.code() is grpc.StatusCode.FAILED_PRECONDITION, (pair, details)
                assert "page_layout" in details and "vllm-0.32.0/" in details, pair
                assert "model_fingerprint" in details, pair  # the fingerprint names the engine
            await blocks_back(vllm_decode, free_d, "the vLLM decode worker freed")
            await blocks_back(vllm_prefill, free_p, "the vLLM prefill worker freed")
            for server in (native_prefill, native_decode):
                engine = server.service.engine  # type: ignore[attr-defined]
                await wait_for(lambda e=engine: _native_free(e), 60.0, "the native worker freed")
        finally:
            await native_decode.shutdown()
            await native_prefill.shutdown()

    asyncio.run(run())


async def _native_free(engine: object) -> bool:
    s = engine.stats  # type: ignore[attr-defined]
    return bool(s.num_free_blocks == s.num_blocks and s.num_pinned == 0)


def test_the_prefix_index_knows_vllms_blocks_by_pdserves_hashes(
    cluster: LocalCluster, vllm_model: Callable[[str], Path], redis_url: str
) -> None:
    prompt = _prompt(4 * BLOCK_SIZE + 3, 90)
    layout = ModelLayout(block_size=BLOCK_SIZE, engine=EngineBackend.VLLM)
    fingerprint = engine_fingerprint(vllm_model("llama"), layout)
    hashes = hash_blocks(root_hash(fingerprint), prompt, BLOCK_SIZE)

    async def run() -> None:
        first = await through_router(cluster.address, prompt, GREEDY)
        assert first.cached_tokens == 0
        index = RedisPrefixIndex.from_url(redis_url, cluster.config.redis_namespace)
        try:

            async def published() -> bool:
                worker_id = cluster.prefill[0].worker_id
                hits = await index.longest_prefixes(hashes, [worker_id])
                return hits[worker_id] == len(hashes)

            await wait_for(published, 60.0, "the prefill worker's blocks in the index")
        finally:
            await index.close()
        again = await through_router(cluster.address, prompt, GREEDY)
        assert again.token_ids == first.token_ids
        assert again.cached_tokens == 4 * BLOCK_SIZE  # every full block, routed to its holder

    asyncio.run(run())


def test_stats_name_the_vllm_layout(cluster: LocalCluster) -> None:
    async def run() -> common_pb2.WorkerStats:
        return await stats(cluster.prefill[0])

    layout = asyncio.run(run()).layout
    assert layout.page_layout.startswith("vllm-0.32.0/")
    assert layout.model_fingerprint.endswith(":vllm") and layout.block_size == BLOCK_SIZE


def test_requests_written_to_break_a_vllm_worker_are_refused_and_kill_nothing(
    cluster: LocalCluster, vllm_model: Callable[[str], Path]
) -> None:
    """A grammar whose tokens bad_words ban (at the first position: refused at admission; at
    the second: the request's error in the step, from the prefill worker or the decode one),
    and bad_words ids past the vocabulary sent to a worker directly (no router to check
    them): named INVALID_ARGUMENT, and every worker process is the one that started."""
    from engine.structured_output import StructuredKind, StructuredOutput
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(vllm_model("llama"))
    assert tokenizer is not None
    (seven,), (eight,) = (tokenizer.encode(t, add_special_tokens=False) for t in ("7", "8"))
    regex = StructuredOutput(StructuredKind.REGEX, "78", "guided_regex")
    pids = [c.process.pid for c in cluster.components]
    cases = {
        "output index 0": dataclasses.replace(GREEDY, structured=regex, bad_words=[[seven]]),
        "output index 1": dataclasses.replace(GREEDY, structured=regex, bad_words=[[seven, eight]]),
    }

    async def run() -> None:
        for message, params in cases.items():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await through_router(cluster.address, _prompt(40, 7), params)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert message in (err.value.details() or "") and "bad_words" in (
                err.value.details() or ""
            )
        sampling = sampling_to_proto(GREEDY)
        sampling.bad_words.append(common_pb2.TokenIds(token_ids=[4294967295]))
        request = decode_pb2.PrefillAndDecodeRequest(
            request_id="huge", prompt_token_ids=_prompt(8), sampling=sampling
        )
        async with grpc.aio.insecure_channel(cluster.decode[0].address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in decode_pb2_grpc.DecodeWorkerStub(channel).PrefillAndDecode(request):
                    pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "bad_words has ids outside the vocabulary" in (err.value.details() or "")
        # A prompt of max_model_len tokens passes pdserve's admission but not vLLM's (it
        # wants a position for the output): refused alone, with the engine core in the worker
        # as in a process of its own (tests/vllm/test_vllm_engine_core.py).
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await colocated(cluster.decode[0].address, _prompt(MAX_MODEL_LEN, 8), GREEDY, "full")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert "vLLM refused request 'full'" in (err.value.details() or "")
        again = await through_router(cluster.address, _prompt(40, 7), GREEDY)
        assert len(again.token_ids) == GREEDY.max_tokens

    asyncio.run(run())
    assert [c.process.pid for c in cluster.components] == pids
    assert all(c.process.poll() is None for c in cluster.components)


def test_a_killed_vllm_decode_worker_mid_stream_loses_no_stream(cluster: LocalCluster) -> None:
    prompts = [_prompt(40 + 9 * i, 100 + i) for i in range(6)]
    params = mixed_params(len(prompts), max_tokens=120)

    async def run() -> None:
        references = [
            await colocated(cluster.decode[0].address, prompt, p, f"ref{i}")
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))
        ]
        streams, _ = await kill_the_busiest_decode_worker(cluster, prompts, params, 180.0)
        for i, (stream, ref) in enumerate(zip(streams, references, strict=True)):
            assert stream.token_ids == ref.token_ids, f"stream {i}"
            assert stream.finish_reason == "length"

    asyncio.run(run())
