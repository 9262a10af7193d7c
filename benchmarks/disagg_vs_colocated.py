"""Disaggregated vs colocated serving under the same open-loop load (CPU).

One invocation runs the same workload (synthetic prompts, Poisson arrivals, same seed) at each
``--rates`` value against two local clusters served by the same router and worker code:
(a) colocated: ``pdserve up --colocated`` with 2 workers that each prefill and decode in one
engine (vLLM-style); (b) disaggregated: 1 prefill + 1 decode worker; (c) planned: what
``pdserve plan`` recommends for the top rate from a profile of this machine (at most
``--plan-max-workers`` workers; ``--no-plan`` skips it). Measured at the client
(``app.bench``): TTFT p90, TPOT p90, goodput (requests/s within both SLOs).

Writes the table and a plot to docs/benchmarks.md and docs/benchmarks/disagg_vs_colocated.png
(``--quick``: a smoke run that writes them to --out instead), and ends with one JSON line.
The host has 2 cores: both setups run 2 worker processes plus a router on them, with torch
using one thread per worker (``--threads``), so neither setup gets more CPU than the other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from bench_inputs import REPO, ensure_model  # sibling module

from app.bench import workload
from app.bench.report import phase_table
from app.bench.runner import LoadConfig, run_load
from app.bench.stats import summarize
from app.capacity.simulator import ClusterShape
from app.local_cluster import ClusterConfig, LocalCluster
from router.phases import RequestPhase


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--rates", default="0.5,1,2", help="request rates, req/s (0.5,1,2)")
    p.add_argument("--num-requests", type=int, default=24, help="requests per rate (24)")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (256)")
    p.add_argument("--output-len", type=int, default=32, help="output tokens (32)")
    p.add_argument("--slo-ttft-ms", type=float, default=1500.0, help="TTFT SLO (1500 ms)")
    p.add_argument("--slo-tpot-ms", type=float, default=150.0, help="TPOT SLO (150 ms)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (1)")
    p.add_argument("--size", choices=("tiny", "small"), default="small", help="checkpoint size")
    p.add_argument("--model", type=Path, help="HF checkpoint dir (default models/bench-llama-*)")
    p.add_argument("--out", type=Path, default=REPO / "docs", help="where the report goes")
    p.add_argument("--quick", action="store_true", help="tiny model, one rate, 4 requests")
    p.add_argument("--no-plan", action="store_true", help="skip the planned configuration")
    p.add_argument("--plan-max-workers", type=int, default=3, help="workers the plan may use (3)")
    args = p.parse_args()
    if args.quick:
        args.rates, args.num_requests, args.size = "4", 4, "tiny"
        args.input_len, args.output_len = 32, 4
    args.rate_list = [float(r) for r in args.rates.split(",")]
    return args


def cluster_config(shape: ClusterShape, model: Path) -> ClusterConfig:
    common: dict[str, Any] = {"model": str(model), "log_level": "WARNING"}
    if shape.num_colocated:
        return ClusterConfig(
            num_prefill=0, num_decode=shape.num_colocated, colocated=True, **common
        )
    # Every request disaggregated: the comparison is about the split, not the shortcut.
    return ClusterConfig(
        num_prefill=shape.num_prefill,
        num_decode=shape.num_decode,
        router_args=("--local-prefill-tokens", "0"),
        **common,
    )


def plan(args: argparse.Namespace, model: Path) -> tuple[ClusterShape, list[dict[str, Any]]]:
    """``pdserve plan`` for the top rate: a profile of this machine (the workers' threads),
    its serving overheads calibrated on a 1:1 cluster, then the search."""
    import torch

    from app.capacity.calibration import calibrate
    from app.capacity.planner import recommend, search
    from app.capacity.profiler import QUICK, ProfilePlan, engine_config
    from app.capacity.profiler import measure as profile_engine

    torch.set_num_threads(args.threads)
    sizes = QUICK if args.quick else ProfilePlan((16, 64, 256, 512), (1, 2, 4, 8, 16), (128, 320))
    config = engine_config(str(model), "float32", "cpu", None, 128, 2048)
    profile = profile_engine(config, "grpc", sizes)
    idle_requests = workload.synthetic(5, args.input_len, args.output_len, seed=20_000)
    with LocalCluster(cluster_config(ClusterShape(1, 1), model)) as cluster:
        records, duration_s = asyncio.run(
            run_load(LoadConfig(cluster.address, concurrency=1), idle_requests)
        )
    profile = calibrate(profile, ClusterShape(1, 1), idle_requests, summarize(records, duration_s))
    top = max(args.rate_list)
    requests = workload.synthetic(
        args.num_requests, args.input_len, args.output_len, int(top * 1000)
    )
    arrivals = workload.poisson_arrivals(len(requests), top, 1)
    slos = (args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    candidates = search(profile, requests, arrivals, *slos, max_workers=args.plan_max_workers)
    best, closest = recommend(candidates)
    chosen = best or closest
    assert chosen is not None
    print(
        f"  plan for {top:g} req/s: {chosen.shape.label}"
        f"{'' if best else ' (closest: none attains 90 %)'}",
        flush=True,
    )
    return chosen.shape, [c.to_json() for c in candidates]


def measure(
    args: argparse.Namespace, mode: str, shape: ClusterShape, model: Path
) -> list[dict[str, Any]]:
    rows = []
    with LocalCluster(cluster_config(shape, model)) as cluster:
        warm = workload.synthetic(2, args.input_len, args.output_len, seed=10_000)
        asyncio.run(run_load(LoadConfig(cluster.address, concurrency=2), warm))
        for rate in args.rate_list:
            requests = workload.synthetic(
                args.num_requests, args.input_len, args.output_len, seed=int(rate * 1000)
            )
            config = LoadConfig(cluster.address, rate=rate, seed=1)
            records, duration_s = asyncio.run(run_load(config, requests))
            s = summarize(records, duration_s, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
            rows.append(
                {
                    "mode": mode,
                    "config": shape.label,
                    "rate": rate,
                    "completed": s.num_completed,
                    "failed": s.num_failed,
                    "ttft_p90_ms": s.ttft_s.p90 * 1e3,
                    "tpot_p90_ms": s.tpot_s.p90 * 1e3,
                    "goodput": s.goodput,
                    "slo_fraction": s.slo_fraction,
                    "throughput": s.request_throughput,
                    # Where the time went, by the router's phases (docs/observability.md).
                    "phases_ms": {
                        name: {"p50": d.p50 * 1e3, "p90": d.p90 * 1e3}
                        for name, d in s.phases_s.items()
                    },
                }
            )
            print(f"  {mode:<14} rate {rate:>4}/s: {json.dumps(rows[-1])}", flush=True)
            print("\n".join(phase_table(s.phases_s)), flush=True)
    return rows


def write_report(args: argparse.Namespace, rows: list[dict[str, Any]], model: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir = args.out / "benchmarks"
    plot_dir.mkdir(parents=True, exist_ok=True)
    plot = plot_dir / "disagg_vs_colocated.png"
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, key, label in zip(
        axes,
        ("ttft_p90_ms", "tpot_p90_ms", "goodput"),
        ("TTFT p90 (ms)", "TPOT p90 (ms)", "goodput (req/s)"),
        strict=True,
    ):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            points = [(r["rate"], r[key]) for r in rows if r["mode"] == mode]
            label = next(f"{mode} ({r['config']})" for r in rows if r["mode"] == mode)
            ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=label)
        ax.set(xlabel="request rate (req/s)", title=label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(plot, dpi=100)
    plt.close(fig)
    lines = [
        "# Benchmarks: disaggregated vs colocated",
        "",
        "Produced by `benchmarks/disagg_vs_colocated.py` (one run; rerun it to refresh).",
        f"Model `{model.name}`, {args.input_len}-token prompts, {args.output_len} output tokens",
        f"(EOS ignored), {args.num_requests} Poisson-arrival requests per rate, SLOs TTFT ≤",
        f"{args.slo_ttft_ms:g} ms and TPOT ≤ {args.slo_tpot_ms:g} ms, measured at the client.",
        "",
        f"CPU: {os.cpu_count()} cores shared by everything. Colocated = 2 workers that each",
        "prefill and decode; disaggregated = 1 prefill + 1 decode worker. Each worker runs torch",
        f"with {args.threads} thread(s), plus one router process in both setups: the same CPU.",
        "",
        "| mode | workers | rate (req/s) | TTFT p90 (ms) | TPOT p90 (ms) | goodput (req/s) "
        "| within SLO |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in sorted(rows, key=lambda r: (r["rate"], r["mode"])):
        lines.append(
            f"| {r['mode']} | {r['config']} | {r['rate']:g} | {r['ttft_p90_ms']:.0f} "
            f"| {r['tpot_p90_ms']:.1f} | {r['goodput']:.2f} | {r['slo_fraction']:.0%} |"
        )
    top = max(args.rate_list)
    at_top = {r["mode"]: r for r in rows if r["rate"] == top}
    modes = list(at_top)
    order = {p.value: i for i, p in enumerate(RequestPhase)}  # the request's own order
    phases = sorted({p for r in at_top.values() for p in r["phases_ms"]}, key=order.__getitem__)
    lines += [
        "",
        f"Where the time went at {top:g} req/s, by the router's phases (ms, p50 / p90 over the "
        "requests; the phases before the first token add up to each request's TTFT; "
        "docs/observability.md):",
        "",
        "| phase | " + " | ".join(modes) + " |",
        "| --- |" + " --- |" * len(modes),
    ]
    for phase in phases:
        cells = [
            "{p50:.1f} / {p90:.1f}".format(**at_top[m]["phases_ms"][phase])
            if phase in at_top[m]["phases_ms"]
            else "—"
            for m in modes
        ]
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    co, dis = at_top["colocated"], at_top["disaggregated"]
    lines += [
        "",
        f"At {top:g} req/s: TPOT p90 {dis['tpot_p90_ms']:.0f} ms disaggregated vs "
        f"{co['tpot_p90_ms']:.0f} ms colocated; TTFT p90 {dis['ttft_p90_ms']:.0f} vs "
        f"{co['ttft_p90_ms']:.0f} ms; goodput "
        f"{dis['goodput']:.2f} vs {co['goodput']:.2f} req/s. With one prefill worker against two "
        "colocated workers, the disaggregated setup has half the prefill capacity on the same "
        "cores, so its TTFT rises first: 1:1 is prefill-bound for this workload.",
        "",
    ]
    if "planned" in at_top:
        planned = at_top["planned"]
        lines += [
            f"Planned = what `pdserve plan` recommends for {top:g} req/s from a profile of this "
            f"machine (the cheapest configuration of at most {args.plan_max_workers} workers that "
            f"keeps 90 % of requests within both SLOs, simulated): {planned['config']}; measured "
            f"TTFT p90 {planned['ttft_p90_ms']:.0f} ms, TPOT p90 {planned['tpot_p90_ms']:.0f} ms, "
            f"goodput {planned['goodput']:.2f} req/s ({planned['slo_fraction']:.0%} within SLO). "
            "The simulator gives each worker its own hardware; here every process shares 2 "
            "cores (docs/capacity.md, benchmarks/planner_accuracy.py).",
            "",
        ]
    lines += [
        f"![TTFT, TPOT and goodput by rate](benchmarks/{plot.name})",
        "",
    ]
    report = args.out / "benchmarks.md"
    # This benchmark owns the file's first section; the others (chaos, serving, ...) stay.
    rest = ""
    if report.exists():
        old = report.read_text()
        start = old.find("\n# ", 1)
        rest = old[start + 1 :] if start >= 0 else ""
    report.write_text("\n".join(lines) + ("\n" + rest if rest else ""))
    return report


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    model = ensure_model(args)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by every worker process
    shapes = {"colocated": ClusterShape(num_colocated=2), "disaggregated": ClusterShape(1, 1)}
    candidates: list[dict[str, Any]] = []
    if not args.no_plan:
        shapes["planned"], candidates = plan(args, model)
    rows = [row for mode, shape in shapes.items() for row in measure(args, mode, shape, model)]
    report = write_report(args, rows, model)
    print(report.read_text())
    wall_s = time.perf_counter() - started
    print(
        json.dumps(
            {"rows": rows, "plan_candidates": candidates, "report": str(report), "wall_s": wall_s}
        )
    )


if __name__ == "__main__":
    main()
