"""``pdserve profile``, ``pdserve simulate`` and ``pdserve plan``: the command lines of the
capacity planner (measure once, then simulate and search in seconds)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from pathlib import Path
from typing import Any

from app.bench.commands import add_workload_flags
from app.capacity.autoscale_command import add_autoscale_command
from app.settings import add_flag
from app.settings.layout_flags import add_layout_flags, layout_of
from app.settings.workers import add_vllm_flags, vllm_options

RESULTS_NAME = "results.json"


def workload(args: argparse.Namespace) -> tuple[list[Any], list[float]]:
    """The requests and their send times: a bench workload at ``--rate``, or the requests
    and send times of a recorded ``pdserve bench --out`` run (prompts re-drawn at their
    recorded lengths: a results file keeps no prompt text)."""
    from app.bench import workload as workloads
    from app.bench.workload import TOKEN_HIGH, TOKEN_LOW, BenchRequest

    path = Path(args.workload)
    if path.name == RESULTS_NAME:
        if not path.is_file():
            raise ValueError(f"--workload {path}: no such file")
        recorded = json.loads(path.read_text())["requests"]
        rng = random.Random(args.seed)
        requests = [
            BenchRequest(
                tuple(rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(r["num_prompt_tokens"])),
                output_len=max(1, r["num_output_tokens"]),
            )
            for r in recorded
        ]
        return requests, [float(r["send_s"]) for r in recorded]
    if args.rate is None or not args.rate > 0:
        raise ValueError("--rate (requests/s, > 0) is required unless --workload is a results.json")
    if args.num_requests < 1 or args.input_len < 1 or args.output_len < 1:
        raise ValueError("--num-requests, --input-len and --output-len must be >= 1")
    requests = workloads.load(
        args.workload, args.num_requests, args.input_len, args.output_len, args.seed
    )
    return requests, workloads.poisson_arrivals(len(requests), args.rate, args.seed)


def _router_model(args: argparse.Namespace) -> Any:
    from app.capacity.simulator import RouterModel

    return RouterModel(
        prefill_policy=args.prefill_policy, local_prefill_tokens=args.local_prefill_tokens
    )


def _add_router_flags(parser: argparse.ArgumentParser) -> None:
    """The router's choices the simulator reproduces (the router's own defaults)."""
    add_flag(
        parser, "--prefill-policy", default="cache_aware", choices=("cache_aware", "least_loaded")
    )
    add_flag(parser, "--local-prefill-tokens", type=int, default=32)
    add_flag(
        parser,
        "--shared-cores",
        type=int,
        default=None,
        help="every worker shares this many CPU cores (one host; default: own hardware each)",
    )


def _slo_s(ms: float | None) -> float | None:
    return ms / 1e3 if ms is not None else None


def _cmd_profile(args: argparse.Namespace) -> int:
    from app.capacity import profile as profile_io
    from app.capacity.profiler import QUICK, ProfilePlan, engine_config, measure

    layout = layout_of(args)
    config = engine_config(
        args.model,
        layout.dtype.value,
        args.device,
        args.num_blocks,
        args.max_num_seqs,
        args.max_num_batched_tokens,
    )
    config = dataclasses.replace(
        config,
        backend=layout.engine,
        cache=dataclasses.replace(
            config.cache, block_size=layout.block_size, kv_cache_dtype=layout.kv_cache_dtype
        ),
        vllm=vllm_options(args),
    )
    print(f"profiling {args.model} ({layout.dtype.value}) ...", file=sys.stderr, flush=True)
    profile = measure(config, args.kv_backend, QUICK if args.quick else ProfilePlan())
    if args.router is not None:
        profile = _calibrated(profile, args)
    profile_io.save(profile, args.out)
    for name in ("prefill", "decode", "transfer"):
        fit = getattr(profile, name)
        pairs = zip(fit.features, fit.coefficients, strict=True)
        terms = ", ".join(f"{f}={c:.3g}" for f, c in pairs)
        print(
            f"{name:<9} intercept={1e3 * fit.intercept:.3f} ms {terms}  "
            f"rmse={1e3 * fit.rmse_s:.3f} ms max residual {fit.max_rel_residual:.0%} "
            f"({fit.num_samples} samples)"
        )
    print(f"wrote {args.out}")
    return 0


def _calibrated(profile: Any, args: argparse.Namespace) -> Any:
    """The serving overheads, from idle requests to a running cluster of this model."""
    import asyncio

    from app.bench import workload as workloads
    from app.bench.runner import LoadConfig, run_load
    from app.bench.stats import summarize
    from app.capacity.calibration import calibrate
    from app.capacity.simulator import ClusterShape

    requests = workloads.synthetic(5, args.calibrate_input_len, args.calibrate_output_len, 20_000)
    records, duration_s = asyncio.run(run_load(LoadConfig(args.router, concurrency=1), requests))
    idle = summarize(records, duration_s)
    if idle.num_failed:
        raise ConnectionError(f"--router {args.router}: {idle.num_failed} of 5 requests failed")
    shape = ClusterShape(num_colocated=1) if args.router_colocated else ClusterShape(1, 1)
    calibrated = calibrate(profile, shape, requests, idle)
    print(
        f"serving overheads from {args.router}: router {1e3 * calibrated.router_overhead_s:.1f}"
        f" ms per request, {1e3 * calibrated.step_overhead_s:.2f} ms per step"
    )
    return calibrated


def _cmd_simulate(args: argparse.Namespace) -> int:
    from app.bench import report
    from app.bench.stats import summarize
    from app.capacity import profile as profile_io
    from app.capacity.simulator import ClusterShape, Simulator

    shape = ClusterShape(args.prefill, args.decode, args.colocated)
    profile = profile_io.load(args.profile)
    requests, arrivals_s = workload(args)
    simulator = Simulator(profile, shape, _router_model(args), args.shared_cores)
    result = simulator.run(requests, arrivals_s)
    summary = summarize(
        result.records, result.duration_s, _slo_s(args.slo_ttft_ms), _slo_s(args.slo_tpot_ms)
    )
    print(f"simulated {shape.label}: {len(requests)} requests ({args.workload})")
    print(report.table(summary))
    if args.out is not None:
        config = {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"
        }
        config["simulated"] = True
        path = report.write_results(args.out, config, summary, result.records)
        print(f"wrote {path}")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from app.capacity import profile as profile_io
    from app.capacity.planner import helm_values, recommend, search

    if args.slo_ttft_ms is None or args.slo_tpot_ms is None:
        raise ValueError("pdserve plan needs --slo-ttft-ms and --slo-tpot-ms")
    if not 0 < args.attainment <= 1:
        raise ValueError(f"--attainment must be in (0, 1], got {args.attainment}")
    profile = profile_io.load(args.profile)
    requests, arrivals_s = workload(args)
    slo_ttft_s, slo_tpot_s = args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3
    candidates = search(
        profile,
        requests,
        arrivals_s,
        slo_ttft_s,
        slo_tpot_s,
        args.max_workers,
        _router_model(args),
        args.shared_cores,
    )
    best, closest = recommend(candidates, args.attainment)
    print(
        f"{'config':<14}{'workers':>8}{'goodput':>10}{'/worker':>9}{'in SLO':>8}"
        f"{'TTFT p90':>11}{'TPOT p90':>11}"
    )
    for c in candidates:
        mark = " <- recommended" if c is best else ""
        print(
            f"{c.shape.label:<14}{c.shape.num_workers:>8}{c.goodput:>10.2f}"
            f"{c.goodput_per_worker:>9.2f}{c.slo_fraction:>8.0%}{1e3 * c.ttft_p90_s:>9.0f}ms"
            f"{1e3 * c.tpot_p90_s:>9.1f}ms{mark}"
        )
    document: dict[str, Any] = {"candidates": [c.to_json() for c in candidates]}
    if best is not None:
        values = helm_values(best, profile)
        print(f"\nrecommended: {best.shape.label}; Helm values:\n{json.dumps(values, indent=2)}")
        document["recommended"] = {**best.to_json(), "helm_values": values}
    else:
        assert closest is not None
        print(
            f"\nno configuration of <= {args.max_workers} workers keeps {args.attainment:.0%} "
            f"of requests within the SLOs; closest: {closest.shape.label} "
            f"({closest.slo_fraction:.0%})"
        )
        document["recommended"] = None
        document["closest"] = closest.to_json()
    print(json.dumps(document))
    return 0 if best is not None else 1


def add_capacity_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    prof = sub.add_parser("profile", help="measure a worker's step and transfer costs")
    add_flag(prof, "--model", required=True, help="HF checkpoint directory")
    add_layout_flags(prof, None)  # the workers'
    add_vllm_flags(prof, None)
    add_flag(prof, "--device", default=None, help="cpu or cuda (default: cuda when present)")
    add_flag(prof, "--num-blocks", type=int, default=None, help="the workers' KV cache blocks")
    add_flag(prof, "--max-num-seqs", type=int, default=128)
    add_flag(prof, "--max-num-batched-tokens", type=int, default=2048)
    add_flag(prof, "--kv-backend", default="grpc", choices=("grpc", "nixl", "local"))
    add_flag(prof, "--quick", action="store_true", help="fewer sizes (a smoke run, seconds)")
    add_flag(
        prof,
        "--router",
        default=None,
        help="a running cluster of this model (gRPC host:port): calibrate the serving overheads",
    )
    add_flag(prof, "--router-colocated", action="store_true", help="that cluster is colocated")
    add_flag(prof, "--calibrate-input-len", type=int, default=256)
    add_flag(prof, "--calibrate-output-len", type=int, default=32)
    add_flag(prof, "--out", type=Path, default=Path("profile.json"))
    prof.set_defaults(func=_cmd_profile)

    sim = sub.add_parser("simulate", help="a cluster in simulated time, from a profile")
    add_flag(sim, "--profile", type=Path, required=True)
    add_flag(sim, "--prefill", type=int, default=0, help="prefill workers")
    add_flag(sim, "--decode", type=int, default=0, help="decode workers")
    add_flag(sim, "--colocated", type=int, default=0, help="colocated workers instead")
    add_workload_flags(sim)
    add_flag(sim, "--rate", type=float, default=None, help="Poisson req/s")
    add_flag(sim, "--out", type=Path, default=None, help="write results.json")
    _add_router_flags(sim)
    sim.set_defaults(func=_cmd_simulate)

    plan = sub.add_parser("plan", help="the P:D split (or colocated) that meets SLOs")
    add_flag(plan, "--profile", type=Path, required=True)
    add_workload_flags(plan)
    add_flag(plan, "--rate", type=float, default=None, help="Poisson req/s")
    add_flag(plan, "--max-workers", type=int, default=8)
    add_flag(plan, "--attainment", type=float, default=0.9, help="share of requests in SLO")
    _add_router_flags(plan)
    plan.set_defaults(func=_cmd_plan)

    add_autoscale_command(sub)
