"""``pdserve bench``: the command line of the load generator."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from app.settings import add_client_flags, add_flag


def _progress(done: int, total: int) -> None:
    width = 30
    filled = width * done // total
    bar = "=" * filled + (">" if filled < width else "") + " " * (width - filled - 1)
    end = "\n" if done == total else ""
    print(f"\r[{bar[:width]}] {done}/{total} requests", end=end, file=sys.stderr, flush=True)


def _cmd_bench(args: argparse.Namespace) -> int:
    from app.bench import report, workload
    from app.bench.runner import LoadConfig, run_load
    from app.bench.stats import summarize

    load = LoadConfig(
        router=args.router if args.http is None else None,
        http=args.http,
        rate=args.rate,
        concurrency=args.concurrency,
        seed=args.seed,
        api_key=args.api_key,
        tls_ca=args.tls_ca,
        tls_server_name=args.tls_server_name,
    )
    if args.num_requests < 1 or args.input_len < 1 or args.output_len < 1:
        raise ValueError("--num-requests, --input-len and --output-len must be >= 1")
    requests = workload.load(
        args.workload, args.num_requests, args.input_len, args.output_len, args.seed
    )
    mode = f"rate {args.rate}/s" if args.rate is not None else f"concurrency {args.concurrency}"
    print(f"pdserve bench: {len(requests)} requests ({args.workload}), {mode}", file=sys.stderr)
    records, duration_s = asyncio.run(run_load(load, requests, _progress))
    slo_ttft_s = args.slo_ttft_ms / 1e3 if args.slo_ttft_ms is not None else None
    slo_tpot_s = args.slo_tpot_ms / 1e3 if args.slo_tpot_ms is not None else None
    summary = summarize(records, duration_s, slo_ttft_s, slo_tpot_s)
    print(report.table(summary))
    if args.out is not None:
        # Never the API key: results.json is shared.
        config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
        config["out"] = str(args.out)
        path = report.write_results(args.out, config, summary, records)
        plots = report.plot(args.out, records, f"{args.workload}, {mode}")
        print(f"wrote {path} and {', '.join(p.name for p in plots)}")
    return 0 if summary.num_failed == 0 else 1


def add_bench_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser("bench", help="load a router; TTFT/TPOT/goodput from the client side")
    frontend = bench.add_mutually_exclusive_group()
    frontend.add_argument("--router", default="127.0.0.1:50051", help="router host:port (gRPC)")
    frontend.add_argument(
        "--http",
        default=None,
        help="the router's OpenAI API instead, http://HOST:PORT (no /v1): /v1/completions",
    )
    add_workload_flags(bench)
    load = bench.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, default=None, help="open loop: Poisson req/s")
    load.add_argument("--concurrency", type=int, default=None, help="closed loop: clients")
    add_flag(bench, "--out", type=Path, default=None, help="write results.json and PNG plots")
    add_client_flags(bench)
    bench.set_defaults(func=_cmd_bench)


def add_workload_flags(parser: argparse.ArgumentParser) -> None:
    """What is sent and how it is judged: ``pdserve bench``, ``simulate`` and ``plan``."""
    add_flag(
        parser,
        "--workload",
        default="synthetic",
        help="synthetic, shared-prefix, or FILE.jsonl (prompt or prompt_token_ids, output_len)",
    )
    add_flag(parser, "--num-requests", type=int, default=100)
    add_flag(parser, "--input-len", type=int, default=256, help="prompt tokens (generated)")
    add_flag(parser, "--output-len", type=int, default=128, help="output tokens (EOS ignored)")
    add_flag(parser, "--slo-ttft-ms", type=float, default=None, help="TTFT target for goodput")
    add_flag(parser, "--slo-tpot-ms", type=float, default=None, help="TPOT target for goodput")
    add_flag(parser, "--seed", type=int, default=0, help="prompts and arrival times")
