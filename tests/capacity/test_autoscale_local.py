"""``pdserve autoscale --target local`` end to end on real processes: a ``pdserve up`` cluster
with its control RPC; load rises -> the decode pool grows; load falls -> it shrinks by
draining the least-loaded worker while streams run on it, and every stream completes; each
decision is in the autoscaler's metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY

from app.capacity.autoscaler import Autoscaler
from app.capacity.load_meter import page_gauges, scrape, totals
from app.capacity.profile import DECODE_FEATURES, LinearFit
from app.capacity.scale_target import LocalTarget, pool_pressure_of
from app.capacity.scaling import Bounds, Reason, ScalingPolicy
from engine import SamplingParams
from pdserve.common.convert import sampling_to_proto
from pdserve.common.role import Role
from pdserve.v1 import router_pb2
from tests.capacity.test_simulator import constant_profile
from tests.integration.cluster_util import generate_many

pytestmark = pytest.mark.slow

# Decode steps cost 0.05 + 0.1 x sequences: within a 0.2 s TPOT one seat per worker, and the
# load needs ceil(3 x rate) decode workers for 16-token outputs (2 at most here): 2 at 1.6/s,
# 1 at 0.006/s.
PROFILE = dataclasses.replace(
    constant_profile(prefill_s=0.001, decode_s=0.05),
    decode=LinearFit(DECODE_FEATURES, 0.05, (0.1, 0.0)),
)
POLICY = ScalingPolicy(
    slo_ttft_s=1.0, slo_tpot_s=0.2, prefill=Bounds(1, 1), decode=Bounds(1, 2),
    interval_s=1.0, cooldown_s=0.0, down_after_intervals=1, correct_profile=False,
)  # fmt: skip


def _request(i: int, max_tokens: int) -> router_pb2.GenerateRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return router_pb2.GenerateRequest(
        prompt_token_ids=[5 + i % 50] * 24, sampling=sampling_to_proto(params)
    )


def _gauge(name: str) -> float:
    value = REGISTRY.get_sample_value(name)
    assert value is not None, name
    return value


def _decisions(reason: Reason) -> float:
    labels = {"pool": "decode", "reason": reason.value}
    return REGISTRY.get_sample_value("pdserve_planner_decisions_total", labels) or 0.0


def test_the_decode_pool_grows_under_load_and_drains_when_it_falls(llama_dir: Path) -> None:
    command = [
        sys.executable, "-m", "app", "up", "--model", str(llama_dir), "--port", "0",
        "--control-port", "0", "--decode-args", "--max-num-seqs 1",
        "--router-args", "--local-prefill-tokens 0",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    control = router = token_file = ""
    for line in process.stdout:
        if line.startswith("pdserve up control-token "):
            token_file = line.split()[-1]
        if line.startswith("pdserve up control "):
            control = line.split()[-1]
        if "cluster ready" in line:
            router = line.split("router ")[1].split(",")[0]
            break
    assert control and router and token_file, f"pdserve up exited with {process.poll()}"
    # Plaintext on a shared host: the pools' sizes need the token only this user can read.
    assert os.stat(token_file).st_mode & 0o777 == 0o600
    with pytest.raises(grpc.RpcError) as err:
        LocalTarget(control).replicas(Role.DECODE)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    with open(token_file) as f:
        target = LocalTarget(control, token=f.read())
    metrics_url = target.router_metrics_url()
    try:
        # The rounds' clock is the test's: the falling-load round spans 1000 s, so the six
        # streams that arrived in it are a rate near 0 while they still run.
        times = iter([0.0, 10.0, 1010.0])
        scaler = Autoscaler(
            PROFILE, POLICY, lambda now_s: {"router": totals(scrape(metrics_url), now_s)},
            target, clock=lambda: next(times), pressure=lambda: pool_pressure_of(target),
        )  # fmt: skip
        ups, downs = _decisions(Reason.UP), _decisions(Reason.DOWN)
        assert scaler.tick() == [] and target.replicas(Role.DECODE) == 1
        # Load rises: 16 requests in 10 s.
        short = asyncio.run(generate_many(router, [_request(i, 16) for i in range(16)]))
        assert all(len(r.token_ids) == 16 for r in short)
        decision = {d.pool: d for d in scaler.tick()}[Role.DECODE]
        assert (decision.target, decision.reason) == (2, Reason.UP)
        assert target.replicas(Role.DECODE) == 2  # started and ready

        # Long streams on both decode workers (one seat each: the rest wait their turn).
        async def streams() -> list[int]:
            running = asyncio.ensure_future(
                generate_many(router, [_request(100 + i, 400) for i in range(6)])
            )
            while page_gauges(scrape(metrics_url))["pdserve_router_inflight_requests"] < 6:
                await asyncio.sleep(0.02)
            # Load falls: 6 arrivals in 1000 s -> one decode worker drains, with streams in
            # flight on it. The decode pool's KV, read from both workers' pages, is in use
            # but below the KV target: it asks for one worker, not two.
            decision = {d.pool: d for d in await asyncio.to_thread(scaler.tick)}[Role.DECODE]
            assert (decision.target, decision.reason) == (1, Reason.DOWN)
            assert 0 < _gauge("pdserve_planner_decode_kv_usage") <= POLICY.kv_target / 2
            assert _gauge("pdserve_planner_prefill_queue_depth") == 0
            return [len(r.token_ids) for r in await running]

        assert asyncio.run(streams()) == [400] * 6  # every stream completed, none failed
        deadline = time.monotonic() + 120
        while target.replicas(Role.DECODE) != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert target.replicas(Role.DECODE) == 1
        assert _decisions(Reason.UP) == ups + 1 and _decisions(Reason.DOWN) == downs + 1
        with urllib.request.urlopen(metrics_url, timeout=10) as reply:
            text = reply.read().decode()
        errors = [
            line for line in text.splitlines() if line.startswith("pdserve_request_errors_total{")
        ]
        assert all(float(line.split()[-1]) == 0 for line in errors), errors
    finally:
        target.close()
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
