"""SLO control (docs/slo.md): two classes and two tenants under an offered load swept past
capacity, with the router's flow control on and off (FCFS: everything sent to the worker at
once) in the same run, on a local cluster (router + one colocated worker, CPU).

- ``modest`` sends ``interactive`` requests (a TTFT target) at a fixed share of capacity;
  ``flood`` sends ``batch`` requests (no target) for the rest of the offered load.
- Capacity: requests per second the cluster completes when every request is sent at once.
- Per load point and mode: per class goodput (interactive: completed within the target; batch:
  completed) per second, shed per second, TTFT p50/p90; the modest tenant alone as the
  reference for isolation.
- Admission's prediction error (the router's ``pdserve_ttft_prediction_error_ratio``) at p90.
- The router's flow control cost per request: enter, release, first token, leave on a waiting
  room holding a queue, in process, against nothing.

Goals (issue 38): interactive goodput at 4x load >= 0.9x its goodput at 1x; the modest
tenant's TTFT p90 with the flood <= 1.2x alone; prediction within 25 % at p90; overhead <=
50 us per request. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_inputs import ensure_model, make_prompts  # sibling module

from app.client import router_channel
from app.local_cluster import ClusterConfig, LocalCluster
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from router.flow_config import FlowConfig
from router.request_class import DEFAULT_CLASS, Tag
from router.waiting_room import WaitingRoom

MODEST_SHARE = 0.25  # of capacity, the interactive tenant's rate at every load point
GOALS = {"goodput_4x_over_1x": 0.9, "isolation_p90": 1.2, "prediction_p90": 0.25, "us": 50.0}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--loads", default="0.5,1,2,4", help="offered load, x capacity")
    p.add_argument("--seconds", type=float, default=20.0, help="arrivals per load point")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--ttft-slo-s", type=float, default=None, help="default: 4x unloaded p50")
    p.add_argument(
        "--max-running", type=int, default=8, help="flow control on: requests per decode worker"
    )
    p.add_argument(
        "--batch-share",
        type=float,
        default=0.25,
        help="flow control on: the batch class's load_share (the rest kept for interactive)",
    )
    p.add_argument("--modes", default="on,off", help="flow control on, off, or both")
    p.add_argument("--size", choices=("tiny", "small"), default="small", help="checkpoint size")
    p.add_argument("--model", type=Path, help="HF checkpoint dir (default models/bench-llama-*)")
    p.add_argument("--quick", action="store_true", help="a short smoke run")
    args = p.parse_args()
    if args.quick:
        args.loads, args.seconds, args.prompt_len, args.size = "1,4", 3.0, 32, "tiny"
    return args


@dataclass
class Outcome:
    tenant: str
    status: str  # ok, shed, error
    ttft_s: float
    end_s: float  # time.perf_counter() at its last byte (or its refusal)


class Load:
    def __init__(self, address: str, args: argparse.Namespace, vocab: int) -> None:
        self.address, self.args, self.vocab = address, args, vocab
        self.sampling = common_pb2.SamplingParams(
            max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True
        )
        self._seed = 0

    async def one(self, stub: router_pb2_grpc.RouterStub, tenant: str, cls: str) -> Outcome:
        self._seed += 1
        prompt = make_prompts(self._seed, 1, self.args.prompt_len, self.vocab)[0]
        request = router_pb2.GenerateRequest(
            prompt_token_ids=prompt, sampling=self.sampling, service_class=cls
        )
        start = time.perf_counter()
        ttft = -1.0
        try:
            stream = stub.Generate(request, metadata=(("x-tenant", tenant),), timeout=600)
            async for response in stream:
                if ttft < 0 and response.HasField("chunk") and response.chunk.token_ids:
                    ttft = time.perf_counter() - start
        except Exception as exc:  # grpc's AioRpcError
            shed = "RESOURCE_EXHAUSTED" in str(exc) or "UNAVAILABLE" in str(exc)
            return Outcome(tenant, "shed" if shed else "error", -1.0, time.perf_counter())
        return Outcome(tenant, "ok", ttft, time.perf_counter())

    async def open_loop(
        self, rates: dict[str, float], seconds: float
    ) -> tuple[list[Outcome], float]:
        """Poisson arrivals per tenant for ``seconds``; every request awaited. Returns the
        outcomes and the seconds from the first arrival to the last answer (over which rates
        are counted: an overloaded run's backlog drains after its arrivals end)."""
        async with router_channel(self.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            tasks: list[asyncio.Task[Outcome]] = []

            async def tenant(name: str, rate: float) -> None:
                cls = "interactive" if name == "modest" else "batch"
                # A tenant's own seed: the modest tenant's arrivals are the same at every load
                # point (and alone), so its goodput and TTFT compare the load, not the draw.
                rng = random.Random(f"{name}-7")
                end = time.perf_counter() + seconds
                while (now := time.perf_counter()) < end:
                    tasks.append(asyncio.create_task(self.one(stub, name, cls)))
                    await asyncio.sleep(min(rng.expovariate(rate), end - now))

            start = time.perf_counter()
            await asyncio.gather(*(tenant(n, r) for n, r in rates.items() if r > 0))
            outcomes = list(await asyncio.gather(*tasks))
            return outcomes, max(o.end_s for o in outcomes) - start

    async def burst(self, n: int) -> float:
        """Requests per second completed when ``n`` are sent at once."""
        async with router_channel(self.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            start = time.perf_counter()
            done = await asyncio.gather(*(self.one(stub, "cal", "batch") for _ in range(n)))
        assert all(o.status == "ok" for o in done), [o.status for o in done]
        return n / (time.perf_counter() - start)


def _router_args(
    slo: float, on: bool, max_running: int = 0, batch_share: float = 1.0
) -> tuple[str, ...]:
    classes = f"interactive:priority=-1,ttft_s={slo:g};"
    classes += f"batch:priority=5,queue_ttl_s=30,load_share={batch_share:g}"
    if not on:  # FCFS: no targets, nothing held back, no TTL
        classes = "interactive;batch"
    inflight = "512" if on else "1000000000"
    flags = {
        "--request-classes": classes,
        "--fairness-header": "x-tenant",
        "--inflight-tokens-per-worker": inflight,
        "--max-running-per-decode-worker": str(max_running if on else 0),
        "--quantum-tokens": "128",
    }
    return tuple(part for flag in flags.items() for part in flag)


def _cluster(model: Path, router_args: tuple[str, ...], on: bool = False) -> ClusterConfig:
    """On: the worker schedules by priority too (the router sends each request's)."""
    return ClusterConfig(
        model=str(model),
        num_prefill=0,
        colocated=True,
        log_level="WARNING",
        router_args=router_args,
        decode_args=("--scheduling-policy", "priority" if on else "fcfs"),
    )


def summarize(
    outcomes: list[Outcome], tenant: str, window_s: float, elapsed_s: float, slo: float
) -> dict[str, Any]:
    """``tenant``'s per second: the interactive tenant's over the arrival window (its
    requests answer within the target or not at all), the flood's over the whole run (an
    overloaded run's backlog is served, or shed, after its arrivals end)."""
    seconds = window_s if tenant == "modest" else elapsed_s
    mine = [o for o in outcomes if o.tenant == tenant]
    ok = [o.ttft_s for o in mine if o.status == "ok"]
    good = [t for t in ok if tenant != "modest" or t <= slo]
    q = statistics.quantiles(ok, n=10) if len(ok) >= 2 else [float("nan")] * 9
    return {
        "sent": len(mine),
        "goodput_rps": len(good) / seconds,
        "shed_rps": sum(o.status == "shed" for o in mine) / seconds,
        "errors": sum(o.status == "error" for o in mine),
        "ttft_p50_s": statistics.median(ok) if ok else float("nan"),
        "ttft_p90_s": q[8],
    }


def prediction_p90(metrics_address: str) -> dict[str, float]:
    """Per class, p90 of the router's prediction error histogram, interpolated linearly
    within its bucket (as Prometheus's ``histogram_quantile``)."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    buckets: dict[str, dict[float, float]] = {}
    for line in lines:
        if line.startswith("pdserve_ttft_prediction_error_ratio_bucket{"):
            name = line.split('class="')[1].split('"')[0]
            le = line.split('le="')[1].split('"')[0]
            bound = float("inf") if le == "+Inf" else float(le)
            buckets.setdefault(name, {})[bound] = float(line.split()[-1])
    return {name: _quantile(0.9, counts) for name, counts in buckets.items()}


def _quantile(q: float, cumulative: dict[float, float]) -> float:
    bounds = sorted(cumulative)
    total = cumulative[bounds[-1]] if bounds else 0.0
    if not total:
        return float("nan")
    lower, below = 0.0, 0.0
    for bound in bounds:
        if cumulative[bound] >= q * total:
            if bound == float("inf"):
                return lower  # past the last finite bucket: its bound, a floor
            share = (q * total - below) / max(cumulative[bound] - below, 1e-12)
            return lower + (bound - lower) * share
        lower, below = bound, cumulative[bound]
    return float("nan")


def run_mode(model: Path, args: argparse.Namespace, on: bool, slo: float, cap: float) -> dict:
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    config = _cluster(model, _router_args(slo, on, args.max_running, args.batch_share), on)
    out: dict[str, Any] = {}
    with LocalCluster(config) as cluster:
        load = Load(cluster.address, args, vocab)
        asyncio.run(load.burst(4))  # warm-up
        alone, elapsed = asyncio.run(load.open_loop({"modest": MODEST_SHARE * cap}, args.seconds))
        out["alone"] = summarize(alone, "modest", args.seconds, elapsed, slo)
        for factor in (float(x) for x in args.loads.split(",")):
            rates = {"modest": MODEST_SHARE * cap, "flood": max(0.0, factor - MODEST_SHARE) * cap}
            outcomes, elapsed = asyncio.run(load.open_loop(rates, args.seconds))
            out[f"{factor:g}x"] = {
                t: summarize(outcomes, t, args.seconds, elapsed, slo) for t in ("modest", "flood")
            }
            print(f"  {'on ' if on else 'off'} {factor:g}x: {out[f'{factor:g}x']}", flush=True)
        assert cluster.router is not None and cluster.router.metrics_address
        out["prediction_error_p90"] = prediction_p90(cluster.router.metrics_address)
    return out


def overhead_us(n: int = 20480) -> tuple[float, float]:
    """Flow control's cost per request on an idle loop, and the same harness's without it:
    64 requests at a time enter, wait their turn (the bound lets one prompt of 64 tokens in
    flight), get their first token and leave; the baseline awaits nothing in their place."""
    room = WaitingRoom(FlowConfig(inflight_tokens_per_worker=64), lambda: 1)

    async def through_room(rid: str, tag: Tag) -> None:
        seat = await room.enter(rid, tag, 64)
        seat.first_token()
        seat.leave()

    async def bare(rid: str, tag: Tag) -> None:
        await asyncio.sleep(0)

    async def run(one: Callable[[str, Tag], Awaitable[None]]) -> float:
        tags = [Tag(f"k{i % 8}", DEFAULT_CLASS) for i in range(64)]
        start = time.perf_counter()
        for batch in range(n // 64):
            await asyncio.gather(*(one(f"r{batch}-{i}", tag) for i, tag in enumerate(tags)))
        return (time.perf_counter() - start) / (n // 64 * 64) * 1e6

    return asyncio.run(run(through_room)), asyncio.run(run(bare))


def calibrate(model: Path, args: argparse.Namespace) -> tuple[float, float]:
    """(capacity in requests/s, unloaded TTFT p50) on a cluster without flow control."""
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    config = _cluster(model, _router_args(1.0, on=False))
    with LocalCluster(config) as cluster:
        load = Load(cluster.address, args, vocab)
        asyncio.run(load.burst(4))  # warm-up
        capacity = asyncio.run(load.burst(8 if args.quick else 32))

        async def unloaded() -> list[float]:
            async with router_channel(cluster.address) as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                return [(await load.one(stub, "cal", "batch")).ttft_s for _ in range(7)]

        ttft = statistics.median(asyncio.run(unloaded()))
    return capacity, ttft


def main() -> None:
    args = parse_args()
    model = ensure_model(args)
    capacity, ttft = calibrate(model, args)
    slo = args.ttft_slo_s or 4 * ttft
    target = f"interactive target {slo * 1000:.0f} ms"
    print(f"capacity {capacity:.2f} req/s, unloaded TTFT p50 {ttft * 1000:.1f} ms, {target}")
    modes = {
        name: run_mode(model, args, on, slo, capacity)
        for name, on in (("on", True), ("off", False))
        if name in args.modes.split(",")
    }
    room_us, bare_us = overhead_us()
    us = room_us - bare_us
    loads = [f"{float(x):g}x" for x in args.loads.split(",")]
    head = ("mode", "load", "int. goodput", "int. p90 ms", "batch goodput", "batch shed", "p50 ms")
    print("\n" + " ".join(f"{h:>13}" for h in head))
    for name, result in modes.items():
        for load in loads:
            m, f = result[load]["modest"], result[load]["flood"]
            row = (m["goodput_rps"], m["ttft_p90_s"] * 1000, f["goodput_rps"], f["shed_rps"])
            cells = [f"{v:>13.2f}" for v in (*row, f["ttft_p50_s"] * 1000)]
            print(f"{name:>13} {load:>13} " + " ".join(cells))
    base = "1x" if "1x" in modes["on"] else loads[0]
    ratios = {
        name: {
            "goodput_4x_over_1x": _ratio(r, "4x", base, "goodput_rps"),
            "isolation_p90": _ratio(r, "4x", "alone", "ttft_p90_s"),
        }
        for name, r in modes.items()
    }
    for key, words, sign in (
        ("goodput_4x_over_1x", f"interactive goodput at 4x / at {base}", ">="),
        ("isolation_p90", "modest tenant TTFT p90 at 4x / alone", "<="),
    ):
        got = ", ".join(f"{name} {r[key]:.2f}" for name, r in ratios.items())
        print(f"{words}: {got} (goal {sign} {GOALS[key]})")
    if "on" in modes:
        # The goal is the interactive class's: admission acts on its prediction (a request
        # without a TTFT target is admitted by its queue's bound); the batch class's shown too.
        error = modes["on"]["prediction_error_p90"]
        got = ", ".join(f"{name} {value:.3f}" for name, value in error.items())
        print(f"prediction error p90, by class: {got} (goal <= {GOALS['prediction_p90']})")
    print(
        f"flow control per request: {us:.1f} us ({room_us:.1f} us through the waiting room, "
        f"{bare_us:.1f} us the same harness without it; goal <= {GOALS['us']:g})"
    )
    report = {
        "benchmark": "slo_control",
        "capacity_rps": capacity,
        "unloaded_ttft_s": ttft,
        "slo_s": slo,
        "modes": modes,
        "ratios": ratios,
        "overhead_us": us,
        "overhead_harness_us": bare_us,
        "goals": GOALS,
    }
    print(json.dumps(report))


def _ratio(result: dict[str, Any], load: str, base: str, key: str) -> float:
    if load not in result or base not in result:
        return float("nan")
    top = result[load]["modest"][key]
    bottom = (result[base] if base == "alone" else result[base]["modest"])[key]
    return top / bottom if bottom else float("nan")


if __name__ == "__main__":
    main()
