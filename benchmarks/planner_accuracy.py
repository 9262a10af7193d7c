"""The capacity planner's simulator against real runs of the same seeded workload.

One invocation: ``pdserve profile`` of this machine (the real engine, the workers' torch
threads), then for each configuration (prefill:decode splits and colocated) and each rate, a
real ``pdserve up`` cluster loaded by ``pdserve bench``'s runner and the simulator on the same
requests and send times. Every real run is repeated (``--repeats``, 3: fresh prompts of the
same lengths, the same send times); "real" is the median of the repeats and the run-to-run
spread is (max - min) / median, per metric. Compared: TTFT and TPOT p50/p90 and goodput;
relative error = |sim - real| / real. A p90 holds when its error is within 20 %, or within the
spread where that is larger (the machine's own noise bounds what any model can predict: the 2
cores are shared by the router and every worker).

``--quick``: 2 configurations x 2 rates (minutes). ``--smoke``: 1 x 1 on the tiny model (CI).
Ends with one JSON line ``{"benchmark": "planner_accuracy", "max_rel_error": ..., "rows": [...]}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from bench_inputs import ensure_model  # sibling module

from app.bench import workload
from app.bench.runner import LoadConfig, run_load
from app.bench.stats import Summary, summarize
from app.capacity.calibration import calibrate
from app.capacity.profile import Profile
from app.capacity.profiler import QUICK, ProfilePlan, engine_config, measure
from app.capacity.simulator import ClusterShape, RouterModel, Simulator
from app.local_cluster import ClusterConfig, LocalCluster

GOAL_P90 = 0.2
SEED = 1  # the arrival draws, real and simulated
CALIBRATION_REQUESTS = 5
METRICS = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "goodput")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--configs", default="1P1D,2P1D,colocated2", help="1P1D,2P1D,colocated2")
    p.add_argument("--rates", default="0.5,1.5", help="request rates, req/s")
    p.add_argument("--num-requests", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3, help="real runs per configuration and rate")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--slo-ttft-ms", type=float, default=1500.0)
    p.add_argument("--slo-tpot-ms", type=float, default=150.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (1)")
    p.add_argument("--size", choices=("tiny", "small"), default="small")
    p.add_argument("--model", type=Path, help="HF checkpoint dir (default models/bench-llama-*)")
    p.add_argument("--quick", action="store_true", help="2 configurations x 2 rates")
    p.add_argument("--smoke", action="store_true", help="1 configuration x 1 rate, tiny model")
    args = p.parse_args()
    if args.quick:
        args.configs, args.num_requests = "1P1D,colocated2", 20
    if args.smoke:
        args.configs, args.rates, args.num_requests, args.size = "1P1D", "2", 8, "tiny"
        args.repeats = 2
        args.input_len, args.output_len = 64, 8
    args.shapes = [_shape(c) for c in args.configs.split(",")]
    args.rate_list = [float(r) for r in args.rates.split(",")]
    return args


def _shape(label: str) -> ClusterShape:
    if label.startswith("colocated"):
        return ClusterShape(num_colocated=int(label.removeprefix("colocated")))
    p, d = label.rstrip("D").split("P")
    return ClusterShape(int(p), int(d))


def _cluster(shape: ClusterShape, model: Path) -> ClusterConfig:
    # No Redis: the router places prefills by load (the simulator's least_loaded).
    common: dict[str, Any] = {"model": str(model), "log_level": "WARNING"}
    if shape.num_colocated:
        return ClusterConfig(
            num_prefill=0, num_decode=shape.num_colocated, colocated=True, **common
        )
    return ClusterConfig(num_prefill=shape.num_prefill, num_decode=shape.num_decode, **common)


def _metrics(s: Summary) -> dict[str, float]:
    return {
        "ttft_p50": s.ttft_s.p50,
        "ttft_p90": s.ttft_s.p90,
        "tpot_p50": s.tpot_s.p50,
        "tpot_p90": s.tpot_s.p90,
        "goodput": s.goodput,
    }


def _requests(
    args: argparse.Namespace, rate: float, seed_offset: int = 0
) -> list[workload.BenchRequest]:
    seed = int(rate * 1e3) + 7919 * seed_offset
    return workload.synthetic(args.num_requests, args.input_len, args.output_len, seed)


def _idle_requests(args: argparse.Namespace) -> list[workload.BenchRequest]:
    return workload.synthetic(CALIBRATION_REQUESTS, args.input_len, args.output_len, 20_000)


def _idle(args: argparse.Namespace, address: str) -> Summary:
    """Requests one at a time: what serving adds to the engine's own costs, unloaded."""
    config = LoadConfig(address, concurrency=1)
    records, duration_s = asyncio.run(run_load(config, _idle_requests(args)))
    return summarize(records, duration_s)


def real_runs(
    args: argparse.Namespace, shape: ClusterShape, model: Path, first: bool
) -> tuple[dict[float, list[dict[str, float]]], Summary | None]:
    """Every rate's ``--repeats`` loaded runs of one configuration (interleaved: repeat r of
    every rate before repeat r + 1, so drift of the machine spreads over all); the first
    configuration also measures idle requests (the calibration)."""
    slos = (args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    out: dict[float, list[dict[str, float]]] = {rate: [] for rate in args.rate_list}
    idle: Summary | None = None
    with LocalCluster(_cluster(shape, model)) as cluster:
        warm = workload.synthetic(2, args.input_len, args.output_len, seed=10_000)
        asyncio.run(run_load(LoadConfig(cluster.address, concurrency=2), warm))
        if first:
            idle = _idle(args, cluster.address)
        for run in range(args.repeats):
            for rate in args.rate_list:
                config = LoadConfig(cluster.address, rate=rate, seed=SEED)
                # Fresh prompts of the same lengths each repeat (the earlier ones are cached
                # now), the same send times.
                requests = _requests(args, rate, seed_offset=run)
                records, duration_s = asyncio.run(run_load(config, requests))
                out[rate].append(_metrics(summarize(records, duration_s, *slos)))
                print(
                    f"  real {shape.label:<13} rate {rate:g}/s #{run + 1}: "
                    f"{json.dumps(out[rate][-1])}",
                    flush=True,
                )
    return out, idle


def median_and_spread(runs: list[dict[str, float]]) -> tuple[dict[str, float], dict[str, float]]:
    """Per metric: the median of the runs, and (max - min) / median."""
    median = {k: statistics.median(r[k] for r in runs) for k in METRICS}
    spread = {
        k: (max(r[k] for r in runs) - min(r[k] for r in runs)) / median[k] if median[k] else 0.0
        for k in METRICS
    }
    return median, spread


def simulated(
    args: argparse.Namespace,
    profile: Profile,
    shape: ClusterShape,
    rate: float,
    shared_cores: int | None,
) -> dict[str, float]:
    requests = _requests(args, rate)
    arrivals_s = workload.poisson_arrivals(len(requests), rate, SEED)
    router = RouterModel(prefill_policy="least_loaded")
    result = Simulator(profile, shape, router, shared_cores).run(requests, arrivals_s)
    slos = (args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    return _metrics(summarize(result.records, result.duration_s, *slos))


def holds(error: float, spread: float) -> bool:
    """A p90's goal: within 20 %, or within the run-to-run spread where that is larger."""
    return error <= max(GOAL_P90, spread)


def print_table(rows: list[dict[str, Any]], sim: str, errors: str, title: str) -> bool:
    """One comparison table; returns whether every p90 held."""
    print(f"\n{title}\n{'config':<14}{'rate':>6}  " + "".join(f"{m:>26}" for m in METRICS))
    for r in rows:
        cells = "".join(
            f"{_fmt(m, r[sim][m])}/{_fmt(m, r['real'][m])} {r[errors][m]:>4.0%} "
            f"±{r['spread'][m]:>4.0%}".rjust(26)
            for m in METRICS
        )
        print(f"{r['config']:<14}{r['rate']:>6g}  {cells}")
    print(
        "(each cell: simulated / real median, relative error, ± the real runs' spread; ms, "
        "goodput in req/s)"
    )
    p90s = [(r[errors][m], r["spread"][m]) for r in rows for m in ("ttft_p90", "tpot_p90")]
    held = sum(holds(e, s) for e, s in p90s)
    within_goal = sum(e <= GOAL_P90 for e, _ in p90s)
    print(
        f"p90s within {GOAL_P90:.0%}: {within_goal}/{len(p90s)}; within 20 % or the spread: "
        f"{held}/{len(p90s)} ({'held' if held == len(p90s) else 'missed'})"
    )
    return held == len(p90s)


def _rel(sim: float, real: float) -> float:
    return abs(sim - real) / real if real > 0 else (0.0 if sim == 0 else float("inf"))


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    model = ensure_model(args)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by every worker process
    torch.set_num_threads(args.threads)  # the profile: one worker's threads
    print(f"profiling {model.name} ({args.threads} thread) ...", flush=True)
    plan = QUICK if args.smoke else ProfilePlan((16, 64, 256, 512), (1, 2, 4, 8, 16), (128, 320))
    profile = measure(engine_config(str(model), "float32", "cpu", None, 128, 2048), "grpc", plan)
    reals: dict[str, dict[float, list[dict[str, float]]]] = {}
    for n, shape in enumerate(args.shapes):
        reals[shape.label], idle = real_runs(args, shape, model, first=n == 0)
        if idle is not None:
            profile = calibrate(profile, shape, _idle_requests(args), idle)
            print(
                f"  calibrated: prefill x{profile.prefill_scale:.2f}, router overhead "
                f"{1e3 * profile.router_overhead_s:.1f} ms, step overhead "
                f"{1e3 * profile.step_overhead_s:.2f} ms",
                flush=True,
            )
    cores = os.cpu_count() or 1
    rows = []
    for shape in args.shapes:
        for rate in args.rate_list:
            real, spread = median_and_spread(reals[shape.label][rate])
            sim = simulated(args, profile, shape, rate, None)
            shared = simulated(args, profile, shape, rate, cores)
            rows.append(
                {
                    "config": shape.label,
                    "rate": rate,
                    "real": real,
                    "spread": spread,
                    "runs": reals[shape.label][rate],
                    "sim": sim,
                    "rel_error": {k: _rel(sim[k], real[k]) for k in METRICS},
                    "sim_shared": shared,
                    "rel_error_shared": {k: _rel(shared[k], real[k]) for k in METRICS},
                }
            )
    held = print_table(rows, "sim", "rel_error", "simulated with one hardware per worker")
    held_shared = print_table(
        rows, "sim_shared", "rel_error_shared", f"simulated with the {cores} cores shared"
    )
    max_rel = max(v for r in rows for v in r["rel_error"].values())
    p90 = ("ttft_p90", "tpot_p90")
    max_p90 = max(r["rel_error"][m] for r in rows for m in p90)
    max_p90_shared = max(r["rel_error_shared"][m] for r in rows for m in p90)
    print(
        json.dumps(
            {
                "benchmark": "planner_accuracy",
                "max_rel_error": max_rel,
                "max_p90_rel_error": max_p90,
                "max_p90_rel_error_shared": max_p90_shared,
                "shared_cores": cores,
                "goal_p90": GOAL_P90,
                "repeats": args.repeats,
                "max_p90_spread": max(r["spread"][m] for r in rows for m in p90),
                "goal_held": held,
                "goal_held_shared": held_shared,
                "profile": profile.to_json(),
                "rows": rows,
                "wall_s": time.perf_counter() - started,
            }
        )
    )


def _fmt(metric: str, value: float) -> str:
    return f"{value:.2f}" if metric == "goodput" else f"{1e3 * value:.0f}"


if __name__ == "__main__":
    main()
