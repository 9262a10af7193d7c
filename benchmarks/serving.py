"""Serving speed against ``vllm serve``, on the same box and model, in one run.

Each server (``servers.SYSTEMS``: ``vllm serve``, pdserve colocated and 1P:1D on the native
engine, and on the vLLM engine) is started once per dtype, warmed up, and driven at every
offered load (Poisson arrivals at each ``--rates``, for each ``--workloads`` of random prompts
with EOS ignored) by ``vllm bench serve`` (vLLM's own client) and, with ``--clients``, by
``pdserve bench``'s. It prints, per dtype, workload, rate and client, request throughput, TTFT
and TPOT p50/p90, and each one's ratio to ``vllm serve`` from the same client, then one JSON
line. Run it in ``.venv-vllm``. Goals (issue 24): pdserve colocated >= 1.0x ``vllm serve``'s
throughput and <= 1.0x its TTFT and TPOT p90 at every load in bf16; 1P:1D >= 0.8x colocated.

``--smoke`` (CI): pdserve colocated only, the tiny model, one short load through vLLM's client:
that the client runs against pdserve and the JSON line comes out.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from bench_inputs import REPO  # sibling module
from servers import (
    BASELINE,
    Load,
    llama_cpp_serve,
    pdserve_client,
    pdserve_up,
    vllm_client,
    vllm_pd,
    vllm_serve,
)
from servers import warm_up as warm

from app.fetch_model import fetch_model
from app.make_model import make_model

CLIENTS = ("vllm", "pdserve")
METRICS = ("req_s", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--systems", default="vllm-serve,native-colocated,native-1p1d")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--rates", default="1,2,4", help="offered loads, requests per second")
    p.add_argument(
        "--workloads", default="random:256:64,chat:1024:128", help="name:input_len:output_len"
    )
    p.add_argument("--num-prompts", type=int, default=40, help="per load")
    p.add_argument("--clients", default="vllm", help=f"subset of {CLIENTS}")
    p.add_argument("--block-size", type=int, default=32, help="vLLM's CPU backend: 32k")
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM's (colocated only)")
    p.add_argument(
        "--model",
        type=Path,
        help="a checkpoint directory, or where to fetch SmolLM2 (default: "
        "models/smollm2-135m-instruct; its 3 KV heads take no TP=2)",
    )
    p.add_argument("--smoke", action="store_true", help="CI: pdserve, tiny model, one load")
    p.add_argument("--logs", help="keep every server's log here (default: a temporary dir)")
    args = p.parse_args()
    if args.smoke:
        args.systems, args.dtypes, args.rates, args.clients = (
            "native-colocated",
            "float32",
            "4",
            "vllm",
        )
        args.workloads, args.num_prompts, args.block_size = "random:32:8", 6, 16
        args.max_model_len, args.kv_cache_bytes = 256, 1 << 24
    return args


def loads(args: argparse.Namespace) -> list[tuple[str, Load]]:
    out: list[tuple[str, Load]] = []
    for workload in args.workloads.split(","):
        name, input_len, output_len = workload.split(":")
        # Named with its lengths: two workloads of one dataset (random 256/64 and 1024/128)
        # must not share a row.
        for rate in args.rates.split(","):
            load = Load(float(rate), args.num_prompts, int(input_len), int(output_len), len(out))
            out.append((f"{name}:{input_len}:{output_len}@{rate}", load))
    return out


def model_dir(args: argparse.Namespace, tmp: Path) -> Path:
    if args.smoke:
        return make_model(tmp / "tiny", "llama", "tiny")
    if args.model is not None and (args.model / "config.json").is_file():
        return Path(args.model)  # a checkpoint of the caller's (one with the KV heads TP=2 needs)
    model, _ = fetch_model("smollm2", args.model or REPO / "models" / "smollm2-135m-instruct")
    return model


def measure(args: argparse.Namespace, model: Path, logs: Path) -> dict[str, Any]:
    """rows[dtype][load][client][system] = the client's summary."""
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    clients = [c for c in args.clients.split(",") if c]
    rows: dict[str, Any] = {}
    for dtype in args.dtypes.split(","):
        for system in args.systems.split(","):
            print(f"== {system} ({dtype})", flush=True)
            if system == BASELINE:
                server = vllm_serve(args, dtype, model, logs)
            elif system == "vllm-pd":
                server = vllm_pd(args, dtype, model, logs)
            elif system.startswith("llama-cpp"):
                server = llama_cpp_serve(args, system, logs)
            else:
                server = pdserve_up(system, args, dtype, model, logs)
            try:
                with server as url:
                    warm(url, vocab)
                    for name, load in loads(args):
                        for client in clients:
                            summary = (
                                vllm_client(url, load, model, logs)
                                if client == "vllm"
                                else pdserve_client(url, load, vocab)
                            )
                            by_system = rows.setdefault(dtype, {}).setdefault(name, {})
                            by_system.setdefault(client, {})[system] = summary
            except (RuntimeError, TimeoutError) as exc:  # a server that did not start
                print(f"   {system}: {exc} (its log: {logs})", flush=True)
                for name, _ in loads(args):
                    for client in clients:
                        by_system = rows.setdefault(dtype, {}).setdefault(name, {})
                        by_system.setdefault(client, {})[system] = {"error": str(exc)}
    return rows


def ratios(by_system: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    base = by_system.get(BASELINE)
    if not base or "error" in base:
        return {}
    return {
        system: {k: row[k] / base[k] for k in ("req_s", "ttft_p90_ms", "tpot_p90_ms")}
        for system, row in by_system.items()
        if "error" not in row
    }


def report(rows: dict[str, Any]) -> None:
    heads = ("system", "req/s", "x", "TTFT p50/p90 ms", "TPOT p50/p90 ms")
    for dtype, by_load in rows.items():
        for load, by_client in by_load.items():
            for client, by_system in by_client.items():
                print(
                    f"\n{dtype} {load} ({client} client): {heads[0]:<17} {heads[1]:>6}", *heads[2:]
                )
                x = ratios(by_system)
                for system, row in by_system.items():
                    if "error" in row:
                        print(f"  {system:<17} error: {row['error']}")
                        continue
                    print(
                        f"  {system:<17} {row['req_s']:>6.2f} "
                        f"{x.get(system, {}).get('req_s', float('nan')):>5.2f} "
                        f"{row['ttft_p50_ms']:>7.0f}/{row['ttft_p90_ms']:<7.0f} "
                        f"{row['tpot_p50_ms']:>7.1f}/{row['tpot_p90_ms']:<7.1f}"
                    )


def goals(rows: dict[str, Any]) -> dict[str, Any]:
    """Issue 24's goals, in bf16, through vLLM's client, at every load measured; issue 36's
    in every dtype measured: pdserve-vLLM colocated >= 1.0x ``vllm serve``'s throughput and
    <= 1.0x its TPOT p90, pdserve-vLLM 1P:1D >= vLLM's own P/D's throughput."""
    vllm_colocated, vllm_split = [], []
    for by_load in rows.values():
        for by_client in by_load.values():
            by_system = by_client.get("vllm", {})
            x = ratios(by_system).get("vllm-colocated")
            if x is not None:
                vllm_colocated.append(x["req_s"] >= 1.0 and x["tpot_p90_ms"] <= 1.0)
            ours, theirs = by_system.get("vllm-1p1d"), by_system.get("vllm-pd")
            if ours and theirs and "error" not in ours and "error" not in theirs:
                vllm_split.append(ours["req_s"] >= theirs["req_s"])
    colocated, one_p_one_d = [], []
    for by_client in rows.get("bfloat16", {}).values():
        by_system = by_client.get("vllm", {})
        x = ratios(by_system).get("native-colocated")
        if x is not None:
            colocated.append(
                x["req_s"] >= 1.0 and x["ttft_p90_ms"] <= 1.0 and x["tpot_p90_ms"] <= 1.0
            )
        split, together = by_system.get("native-1p1d"), by_system.get("native-colocated")
        if split and together and "error" not in split and "error" not in together:
            one_p_one_d.append(split["req_s"] >= 0.8 * together["req_s"])
    return {
        "colocated_at_least_vllm_serve": bool(colocated) and all(colocated),
        "one_p_one_d_at_least_0.8x_colocated": bool(one_p_one_d) and all(one_p_one_d),
        "vllm_colocated_at_least_vllm_serve": bool(vllm_colocated) and all(vllm_colocated),
        "vllm_1p1d_at_least_vllm_pd": bool(vllm_split) and all(vllm_split),
    }


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(args.logs) if args.logs else Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        rows = measure(args, model_dir(args, logs), logs)
    report(rows)
    result = {
        "benchmark": "serving",
        "smoke": args.smoke,
        "num_prompts": args.num_prompts,
        "rows": rows,
        "ratios_to_vllm_serve": {
            dtype: {
                load: {client: ratios(s) for client, s in by_client.items()}
                for load, by_client in by_load.items()
            }
            for dtype, by_load in rows.items()
        },
        "goals": goals(rows),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
