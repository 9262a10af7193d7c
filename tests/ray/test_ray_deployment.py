"""pdserve on the session's local Ray: router and pools as Ray actors (through the `pdserve ray`
command line), KV through the object store, runtime scaling, and a killed actor."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import ray

from app.client import GenerateResult, generate, router_channel
from app.ray_deploy import deployment
from app.ray_deploy.service_actor import ServiceInfo
from engine import SamplingParams
from native_engine import LLM
from pdserve.common.role import Role
from pdserve.v1 import common_pb2, prefill_pb2_grpc, router_pb2, router_pb2_grpc
from tests.integration.cluster_util import generate_many, run
from tests.integration.test_cluster import _prompts, _request
from tests.services.harness import wait_for

pytestmark = pytest.mark.slow

LONG = common_pb2.SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)


def _cli(address: str, namespace: str, *args: str) -> str:
    command = [sys.executable, "-m", "app", "ray", *args]
    command += ["--address", address, "--namespace", namespace]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def namespace(ray_address: str, llama_dir: Path) -> Iterator[str]:
    """One deployment (1 prefill + 2 decode + a KV store, Ray transfer, embedded Redis) for
    the module."""
    name = f"pdserve-{uuid.uuid4().hex[:8]}"
    out = _cli(
        ray_address, name, "up", "--model", str(llama_dir), "--prefill", "1", "--decode", "2",
        "--num-cpus-per-worker", "0", "--port", "0", "--kv-backend", "ray", "--kvstore", "1",
        "--router-args", "--local-prefill-tokens 0",  # every request takes the transfer path
    )  # fmt: skip
    assert "pdserve on ray ready: router " in out
    try:
        yield name
    finally:
        _cli(ray_address, name, "down")


def _router(namespace: str) -> str:
    return deployment.router_address(deployment.status(namespace))


def _worker(namespace: str, actor: str) -> ServiceInfo:
    return next(i for i in deployment.status(namespace) if i.name == actor)


def _reference(
    make_llm: Callable[..., LLM], model: Path, prompts: list[list[int]]
) -> list[list[int]]:
    params = SamplingParams(max_tokens=LONG.max_tokens, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in make_llm(model).generate(prompts, params)]


async def _streams_with_action(
    router: str, prompts: list[list[int]], action: Callable[[], object]
) -> list[GenerateResult | BaseException]:
    """Starts one stream per prompt; once every stream is decoding (a few text deltas in; the
    first token comes from the prefill worker), runs ``action`` (blocking, in a thread) while
    they go on."""
    started = [asyncio.Event() for _ in prompts]
    async with router_channel(router) as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        async def one(i: int) -> GenerateResult:
            request = router_pb2.GenerateRequest(prompt_token_ids=prompts[i], sampling=LONG)
            deltas = 0

            def on_text(_: str) -> None:
                nonlocal deltas
                deltas += 1
                if deltas >= 3:
                    started[i].set()

            return await generate(stub, request, on_text, timeout_s=300)

        tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
        await asyncio.to_thread(action)
        return await asyncio.gather(*tasks, return_exceptions=True)


def test_outputs_match_one_engine_for_16_mixed_prompts(
    namespace: str, llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    prompts = _prompts()
    requests, params = [], []
    for i, prompt in enumerate(prompts):
        if i % 2:  # half greedy, half seeded sampling
            sampling = common_pb2.SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=i)
            params.append(SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=i))
        else:
            sampling = common_pb2.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
            params.append(SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        requests.append(_request(prompt, sampling))
    results = run(generate_many(_router(namespace), requests))
    reference = make_llm(llama_dir).generate(prompts, params)  # type: ignore[arg-type]
    for result, expected in zip(results, reference, strict=True):
        assert result.token_ids == expected.token_ids
        assert result.text == expected.text
        assert result.finish_reason == expected.finish_reason
        assert result.transfer_s > 0  # the KV came through the object store


def test_killed_decode_actor_streams_migrate_and_it_is_restarted(
    namespace: str, llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    deployment.scale(namespace, Role.DECODE, 2)
    victim = _worker(namespace, "pdserve-decode-0")
    prompts = [[11 + i] * (20 + 3 * i) for i in range(8)]
    expected = _reference(make_llm, llama_dir, prompts)

    def kill() -> None:
        ray.kill(ray.get_actor(victim.name, namespace=namespace), no_restart=False)

    outcomes = run(_streams_with_action(_router(namespace), prompts, kill))
    # The streams on the killed worker migrated: every one completes with one engine's tokens.
    for outcome, tokens in zip(outcomes, expected, strict=True):
        assert isinstance(outcome, GenerateResult), outcome
        assert outcome.token_ids == tokens
    # New requests succeed meanwhile: the router routes around the dead worker.
    again = run(generate_many(_router(namespace), [_request(p, LONG) for p in prompts]))
    assert [r.token_ids for r in again] == expected

    async def restarted() -> bool:
        info = await asyncio.to_thread(_worker, namespace, victim.name)
        return info.pid not in (0, victim.pid) and bool(info.address)

    run(wait_for(restarted, 120.0, "Ray restarted the killed decode actor", poll_s=0.5))
    back = _worker(namespace, victim.name)
    assert back.worker_id != victim.worker_id  # a new process registers under a new id

    command = [sys.executable, "-m", "app", "status"]
    command += ["--redis", deployment.redis_url(namespace)]

    async def status_shows_only_the_new_id() -> bool:
        # The dead process's record leaves the registry when its TTL (3 s) runs out.
        status = await asyncio.to_thread(
            subprocess.run, command, capture_output=True, text=True, timeout=60, check=True
        )
        return back.worker_id in status.stdout and victim.worker_id not in status.stdout

    run(wait_for(status_shows_only_the_new_id, 30.0, "status lists the new id only", poll_s=0.5))


def test_scale_prefill_up_and_decode_down_at_runtime(
    ray_address: str, namespace: str, llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    deployment.scale(namespace, Role.PREFILL, 1)
    deployment.scale(namespace, Role.DECODE, 2)
    out = _cli(ray_address, namespace, "scale", "prefill", "2")
    assert "pdserve-prefill-1" in out
    added = _worker(namespace, "pdserve-prefill-1")

    async def added_worker_prefilled() -> bool:
        prompt = [int(x, 16) % 1000 + 1 for x in uuid.uuid4().hex[:24]]  # uncached anywhere
        await generate_many(_router(namespace), [_request(prompt, LONG)])
        async with grpc.aio.insecure_channel(added.address) as channel:
            stats = await prefill_pb2_grpc.PrefillWorkerStub(channel).GetStats(
                common_pb2.GetStatsRequest()
            )
        return stats.num_prompt_tokens_computed > 0

    run(wait_for(added_worker_prefilled, 30.0, "the added prefill worker gets traffic"))

    # Scale decode 2 -> 1 while streams run on both: the removed worker drains them.
    prompts = [[40 + i] * (24 + 5 * i) for i in range(8)]
    expected = _reference(make_llm, llama_dir, prompts)
    outcomes = run(
        _streams_with_action(
            _router(namespace),
            prompts,
            lambda: _cli(ray_address, namespace, "scale", "decode", "1"),
        )
    )
    assert [o.token_ids if isinstance(o, GenerateResult) else o for o in outcomes] == expected
    names = [i.name for i in deployment.status(namespace)]
    assert "pdserve-decode-1" not in names and "pdserve-decode-0" in names
    assert "pdserve-prefill-1" in _cli(ray_address, namespace, "status")


def test_up_with_a_bad_model_path_says_so_and_leaves_nothing(
    ray_address: str, tmp_path: Path
) -> None:
    name = f"pdserve-{uuid.uuid4().hex[:8]}"
    command = [sys.executable, "-m", "app", "ray", "up", "--address", ray_address]
    command += ["--namespace", name, "--model", str(tmp_path / "nothing"), "--port", "0"]
    command += ["--num-cpus-per-worker", "0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert f"no config.json in {tmp_path / 'nothing'}" in done.stderr
    with pytest.raises(ValueError, match="no pdserve deployment"):
        deployment.controller(name)  # no restart loop, nothing left running

    async def actors_gone() -> bool:  # owned by the controller: they die with it
        try:
            await asyncio.to_thread(ray.get_actor, "pdserve-router", namespace=name)
        except ValueError:
            return True
        return False

    run(wait_for(actors_gone, 30.0, "the failed deployment's actors removed", poll_s=0.2))


def test_the_autoscaler_resizes_a_ray_deployment(namespace: str) -> None:
    from app.capacity.autoscaler import Autoscaler
    from app.capacity.load_meter import scrape, totals
    from app.capacity.scale_target import RayTarget
    from app.capacity.scaling import Reason
    from tests.capacity.test_autoscale_local import POLICY, PROFILE
    from tests.capacity.test_autoscale_local import _request as request

    deployment.scale(namespace, Role.PREFILL, 1)
    deployment.scale(namespace, Role.DECODE, 1)
    target = RayTarget(namespace)
    url = target.router_metrics_url()
    times = iter([0.0, 10.0, 1010.0])  # the last round: no arrivals in 1000 s
    scaler = Autoscaler(
        PROFILE, POLICY, lambda now_s: {"router": totals(scrape(url), now_s)}, target,
        clock=lambda: next(times),
    )  # fmt: skip
    assert scaler.tick() == [] and target.replicas(Role.DECODE) == 1
    run(generate_many(_router(namespace), [request(i, 16) for i in range(16)]))
    decision = {d.pool: d for d in scaler.tick()}[Role.DECODE]
    assert (decision.target, decision.reason) == (2, Reason.UP)
    assert target.replicas(Role.DECODE) == 2
    decision = {d.pool: d for d in scaler.tick()}[Role.DECODE]  # nothing arrived since
    assert (decision.target, decision.reason) == (1, Reason.DOWN)
    assert target.replicas(Role.DECODE) == 1


def test_a_kv_store_actor_registers_and_the_router_knows_it(namespace: str) -> None:
    """``pdserve ray up --kvstore 1``: the store is an actor of the deployment, serves its
    stats, and the router counts it among its routable stores (it learned it from Redis)."""
    store = _worker(namespace, "pdserve-kvstore-0")
    assert store.role is Role.KVSTORE and store.worker_id.startswith("kvstore")

    async def stats() -> common_pb2.WorkerStats:
        async with grpc.aio.insecure_channel(store.address) as channel:
            stub = prefill_pb2_grpc.PrefillWorkerStub(channel)
            return await stub.GetStats(common_pb2.GetStatsRequest())

    assert run(stats()).num_blocks > 0
    router = _worker(namespace, "pdserve-router")

    async def known() -> bool:
        return (
            _scrape(router.metrics_address, 'pdserve_router_healthy_workers{pool="kvstore"}') == 1
        )

    run(wait_for(known, 30.0, "the router sees the store"))


def _scrape(address: str, sample: str) -> float:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(sample + " "))
