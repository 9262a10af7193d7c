"""The chaos benchmark's fault scenarios (``chaos.py`` runs them): each is a cluster shape and
a schedule of faults injected while the load runs, one at a time, each ending (worker back,
process resumed, Redis back) before the next. Every fault is timed from injection to the
router's reaction: the worker leaves routing (``pdserve_router_healthy_workers`` falls), or
Redis is seen down (``pdserve_redis_up``): the time to detection reported."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from app.client import router_channel
from app.embedded_redis import EmbeddedRedis
from app.local_cluster import Component, LocalCluster
from app.settings.flags import field_default
from pdserve.common.role import Role
from pdserve.common.server import ServerConfig
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

STUCK_AT_STEP = 150  # the stuck-step scenario's extra decode worker blocks at this step


@dataclass
class Fault:
    what: str
    detection_s: float | None = None  # None: the router never reacted within the bound
    timed: bool = True  # False: a tally (hostile scenarios), no reaction to time


@dataclass
class Schedule:
    """What one scenario did (filled in while it runs)."""

    faults: list[Fault] = field(default_factory=list)


def router_metric(cluster: LocalCluster, name: str) -> float:
    assert cluster.router is not None
    url = f"http://{cluster.router.metrics_address}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    return sum(
        float(x.split()[-1]) for x in lines if x.startswith(name + "{") or x.startswith(name + " ")
    )


def _timed(cluster: LocalCluster, reacted: Callable[[], bool], bound_s: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < bound_s:
        if reacted():
            return time.monotonic() - start
        time.sleep(0.05)
    return None


def _unroutable(cluster: LocalCluster) -> Callable[[], bool]:
    """Once the router routes to every live worker (waited for): a check that is true once
    it routes to fewer."""
    live = len([c for c in [*cluster.prefill, *cluster.decode] if c.process.poll() is None])

    def routed() -> float:
        return router_metric(cluster, "pdserve_router_healthy_workers")

    if _timed(cluster, lambda: routed() >= live, 120.0) is None:
        raise TimeoutError(f"the router does not route to all {live} live workers")
    return lambda: routed() < live


def wait_restarted(cluster: LocalCluster, victim: Component, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        current = next(c for c in cluster.components if c.name == victim.name)
        if current is not victim and current.address:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{victim.name} was not restarted within {timeout_s} s")


def _busiest_worker(cluster: LocalCluster, rng: random.Random, role: Role | None) -> Component:
    group = cluster.decode if role is Role.DECODE else [*cluster.prefill, *cluster.decode]
    return rng.choice([c for c in group if c.address and c.process.poll() is None])


def mixed(
    cluster: LocalCluster, redis: EmbeddedRedis, stall_s: float, duration_s: float, seed: int
) -> Schedule:
    """kill -9 of a worker, SIGSTOP of one past the stall timeout, a Redis restart."""
    rng, schedule = random.Random(seed), Schedule()
    gap_s = duration_s / 4
    time.sleep(gap_s)
    victim = _busiest_worker(cluster, rng, Role.DECODE)
    reacted = _unroutable(cluster)
    victim.process.send_signal(signal.SIGKILL)
    schedule.faults.append(Fault(f"kill -9 {victim.name}", _timed(cluster, reacted, 120.0)))
    wait_restarted(cluster, victim)
    time.sleep(gap_s)
    victim = _busiest_worker(cluster, rng, Role.DECODE)
    reacted = _unroutable(cluster)
    os.kill(victim.process.pid, signal.SIGSTOP)
    try:
        detected = _timed(cluster, reacted, stall_s + 30.0)
    finally:
        os.kill(victim.process.pid, signal.SIGCONT)
    schedule.faults.append(Fault(f"SIGSTOP {victim.name}", detected))
    time.sleep(gap_s)
    redis.kill()
    down = _timed(cluster, lambda: router_metric(cluster, "pdserve_redis_up") == 0, 30.0)
    redis.start()
    schedule.faults.append(Fault("kill -9 redis-server, restarted", down))
    return schedule


def stuck_step(
    cluster: LocalCluster, redis: EmbeddedRedis, stall_s: float, duration_s: float, seed: int
) -> Schedule:
    """A third decode worker whose engine step blocks for good (outside the GIL, as a hung
    device sync) at step ``STUCK_AT_STEP``: its streams must move, it must leave routing."""
    schedule = Schedule()
    stuck = cluster.spawn_worker(Role.DECODE, ("--fault-stall-at-step", str(STUCK_AT_STEP)))
    stuck.wait_ready(cluster.config.ready_timeout_s)
    reacted = _unroutable(cluster)
    detected = _timed(cluster, reacted, duration_s + stall_s + 60.0)
    schedule.faults.append(Fault(f"{stuck.name} step {STUCK_AT_STEP} blocks", detected))
    # What a kubelet does: its liveness probe (/livez, failing once no step completed for
    # --liveness-stall-s) fails, and the container is killed (its blocks go with it).
    livez = f"http://{stuck.metrics_address}/livez"
    failing = _timed(cluster, lambda: not _answers_ok(livez), 300.0)
    schedule.faults.append(Fault(f"{stuck.name} /livez fails", failing))
    stuck.process.kill()
    stuck.process.wait()
    return schedule


def _answers_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return bool(reply.status == 200)
    except OSError:  # HTTPError (503) included
        return False


def redis_outage_restart(
    cluster: LocalCluster, redis: EmbeddedRedis, stall_s: float, duration_s: float, seed: int
) -> Schedule:
    """Redis down, then a decode worker killed and restarted during the outage (it comes back
    from its last-known peers), then Redis back."""
    rng, schedule = random.Random(seed), Schedule()
    time.sleep(duration_s / 4)
    redis.kill()
    down = _timed(cluster, lambda: router_metric(cluster, "pdserve_redis_up") == 0, 30.0)
    schedule.faults.append(Fault("kill -9 redis-server", down))
    victim = _busiest_worker(cluster, rng, Role.DECODE)
    reacted = _unroutable(cluster)
    victim.process.send_signal(signal.SIGKILL)
    schedule.faults.append(Fault(f"kill -9 {victim.name}", _timed(cluster, reacted, 120.0)))
    wait_restarted(cluster, victim)
    time.sleep(duration_s / 4)
    redis.start()
    up = _timed(cluster, lambda: router_metric(cluster, "pdserve_redis_up") == 1, 30.0)
    schedule.faults.append(Fault("redis-server back (seen up)", up))
    return schedule


def _worker_metric(worker: Component, name: str) -> float:
    url = f"http://{worker.metrics_address}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    return sum(float(x.split()[-1]) for x in lines if x.startswith(name + " "))


def frozen_router(
    cluster: LocalCluster, redis: EmbeddedRedis, stall_s: float, duration_s: float, seed: int
) -> Schedule:
    """The router SIGSTOPped (a frozen or partitioned router sends no reset) while 4 long
    streams of its own run beside the load, for longer than the workers' keepalive bound
    (2 x --keepalive-s, 40 s): the decode workers must cut its calls and free their KV within
    that bound. Resumed, the router carries on: the long streams' relays failed, so they
    migrate and finish; the load's streams that waited through the freeze finish too."""
    assert cluster.router is not None
    schedule = Schedule()
    keepalive_s = float(field_default(ServerConfig, "keepalive_s"))
    time.sleep(duration_s / 3)
    decode = [c for c in cluster.decode if c.process.poll() is None]
    long_streams = _LongStreams(cluster.address, count=4, max_tokens=480)

    def busy() -> bool:
        return sum(_worker_metric(w, "pdserve_running_requests") for w in decode) >= 4

    if _timed(cluster, busy, 60.0) is None:
        raise TimeoutError("the long streams did not start")
    os.kill(cluster.router.process.pid, signal.SIGSTOP)
    try:
        held = ("pdserve_running_requests", "pdserve_paused_requests", "pdserve_queue_depth")

        def freed() -> bool:  # no request left: running, paused for its reader, or waiting
            return all(_worker_metric(w, name) == 0 for w in decode for name in held)

        detected = _timed(cluster, freed, 2 * keepalive_s + 30.0)
    finally:
        os.kill(cluster.router.process.pid, signal.SIGCONT)
    what = f"SIGSTOP router, decode KV freed (bound {2 * keepalive_s:g} s)"
    schedule.faults.append(Fault(what, detected))
    ended = long_streams.wait()
    schedule.faults.append(Fault(f"4 long streams after SIGCONT: {ended}"))
    return schedule


class _LongStreams:
    """``count`` greedy streams of ``max_tokens`` through the router, in a thread of their own;
    ``wait`` returns how they ended ("4 completed", or the errors)."""

    def __init__(self, address: str, count: int, max_tokens: int) -> None:
        self._ended: list[str] = []
        # Top logprobs make each message large: the stream outgrows the relay's 16 KiB flow
        # control window within the tiny model's context, so a frozen reader stalls it.
        sampling = common_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=20
        )
        self._requests = [
            router_pb2.GenerateRequest(prompt_token_ids=[3 + i, 5, 7], sampling=sampling)
            for i in range(count)
        ]
        self._thread = threading.Thread(target=asyncio.run, args=(self._run(address),))
        self._thread.start()

    async def _run(self, address: str) -> None:
        async with router_channel(address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)

            async def one(request: router_pb2.GenerateRequest) -> str:
                try:
                    async for _ in stub.Generate(request, timeout=600):
                        pass
                except grpc.aio.AioRpcError as exc:
                    return exc.code().name
                return "completed"

            self._ended = list(await asyncio.gather(*(one(r) for r in self._requests)))

    def wait(self) -> str:
        self._thread.join()
        return ", ".join(f"{self._ended.count(e)} {e}" for e in sorted(set(self._ended)))


Scenario = Callable[[LocalCluster, EmbeddedRedis, float, float, int], Schedule]
SCENARIOS: dict[str, Scenario] = {
    "mixed": mixed,
    "stuck-step": stuck_step,
    "redis-outage-restart": redis_outage_restart,
    "frozen-router": frozen_router,
}
