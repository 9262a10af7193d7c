"""Offline decode throughput, pdserve's native engine vs vLLM's own ``LLM``, in one run.

Both engines load the same checkpoint in the same process (vLLM's engine core in-process, with
its default torch.compile) and decode the same random prompts greedily, EOS ignored, one
engine at a time. Decode tok/s = batch x (N - 1) / (t(max_tokens=N) - t(max_tokens=1)), best
of the repeats, so prefill is left out; prefill tok/s is the batch's prompt tokens over
t(max_tokens=1) (one step: the prompts, and the first token). The same run measures this
box's copy bandwidth (benchmarks/memory_limit.py) and reports each decode figure as a share
of the weight-read limit, batch x bandwidth / the bytes of weights a step reads. Where
``make install-llama-cpp`` has built llama.cpp, the same run drives its ``llama-batched-bench``
on the same prompt and decode lengths (benchmarks/llama_cpp.py), on the bf16 GGUF of the same
weights and on the Q4_1 GGUF they came from. Prints the tables with ratios (native / vLLM,
native / llama.cpp) and shares, the native engine's GEMM kernel, then one JSON line. Run in
the vLLM environment:

    .venv-vllm/bin/python benchmarks/offline_engines.py [--dtype bfloat16] [--batches 1,8,32]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llama_cpp  # sibling module
import torch
from bench_inputs import REPO, make_prompts  # sibling module
from memory_limit import copy_gb_s, decode_weight_bytes, weight_read_limit_tok_s

from app.fetch_model import fetch_model
from app.make_model import make_model
from engine import SamplingParams
from engine.config import DEFAULT_CPU_KV_CACHE_BYTES
from native_engine import LLM
from native_engine.kernels import small_gemm

QUICK_KV_BYTES = 32 << 20
# (prompts, max_tokens) -> seconds
Runner = Callable[[list[list[int]], int], float]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="default: the real SmolLM2")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=65)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="CI: a tiny model, fp32, batches 1,2")
    p.add_argument(
        "--llama-cpp",
        type=Path,
        default=llama_cpp.DEFAULT_DIR,
        help="llama.cpp's build (make install-llama-cpp); skipped where absent, and with --quick",
    )
    args = p.parse_args()
    if args.quick:
        args.dtype, args.batches, args.prompt_len, args.new_tokens = "float32", "1,2", 16, 32
    return args


def native_runner(model: Path, dtype: str, quick: bool, prompt_len: int) -> Runner:
    kv_bytes = QUICK_KV_BYTES if quick else DEFAULT_CPU_KV_CACHE_BYTES
    llm = LLM(str(model), dtype=dtype, block_size=32, kv_cache_bytes=kv_bytes)

    def run(prompts: list[list[int]], n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - start

    return run


def vllm_runner(model: Path, dtype: str, quick: bool, prompt_len: int) -> Runner:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM as VllmLLM
    from vllm import SamplingParams as VllmParams
    from vllm.inputs import TokensPrompt

    llm = VllmLLM(
        str(model),
        dtype=dtype,
        block_size=32,  # vLLM's CPU attention: a multiple of 32
        max_model_len=512 if quick else max(2048, prompt_len + 128),
        kv_cache_memory_bytes=QUICK_KV_BYTES if quick else DEFAULT_CPU_KV_CACHE_BYTES,
        enforce_eager=quick,  # torch.compile: seconds per start, nothing to gain on a tiny model
        seed=0,
        disable_log_stats=True,
    )

    def run(prompts: list[list[int]], n: int) -> float:
        params = VllmParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        start = time.perf_counter()
        llm.generate(inputs, params, use_tqdm=False)
        return time.perf_counter() - start

    return run


def llama_peers(
    args: argparse.Namespace,
) -> dict[str, tuple[list[llama_cpp.BatchedFigures], str]]:
    """llama.cpp on both GGUFs, the same lengths: decode N - 1 tokens after the prompt."""
    batches = [int(b) for b in args.batches.split(",")]
    return {
        gguf: llama_cpp.batched_bench(
            args.llama_cpp, gguf, args.prompt_len, args.new_tokens - 1, batches
        )
        for gguf in llama_cpp.GGUFS
    }


def measure(run: Runner, batch: int, args: argparse.Namespace, vocab: int) -> tuple[float, float]:
    """Decode tok/s, and prefill tok/s: the batch's prompt tokens over t(max_tokens=1)."""

    def prompts(seed: int) -> list[list[int]]:
        return make_prompts(seed, batch, args.prompt_len, vocab)

    run(prompts(batch), 4)  # warm-up: compiles, first-touch pages
    full = min(run(prompts(100 * batch + r), args.new_tokens) for r in range(args.repeats))
    first = min(run(prompts(200 * batch + r), 1) for r in range(args.repeats))
    return batch * (args.new_tokens - 1) / (full - first), batch * args.prompt_len / first


def main() -> None:
    args = parse_args()
    if args.quick:  # vLLM's CPU attention needs head_dim 64: tiny64
        model = make_model(Path(tempfile.mkdtemp()) / "tiny64", "llama", "tiny64")
    else:
        model, _ = fetch_model("smollm2", args.model or REPO / "models" / "smollm2-135m-instruct")
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    batches = [int(b) for b in args.batches.split(",")]
    results: dict[str, dict[int, float]] = {}
    prefill: dict[str, dict[int, float]] = {}  # prompt tok/s
    for name, build in (("native", native_runner), ("vllm", vllm_runner)):
        run = build(model, args.dtype, args.quick, args.prompt_len)
        measured = {b: measure(run, b, args, vocab) for b in batches}
        results[name] = {b: m[0] for b, m in measured.items()}
        prefill[name] = {b: m[1] for b, m in measured.items()}
        del run
        gc.collect()
    peers = {} if args.quick or not llama_cpp.available(args.llama_cpp) else llama_peers(args)
    gb_s = copy_gb_s(size_bytes=QUICK_KV_BYTES if args.quick else None)
    weight_bytes = decode_weight_bytes(model, 2 if args.dtype == "bfloat16" else 4)
    isa = small_gemm.chosen(getattr(torch, args.dtype))
    gemm = isa.name if isa is not None else "onednn"
    rows: list[dict[str, Any]] = []
    print(f"offline decode tok/s, {args.dtype}, {args.prompt_len}-token prompts, greedy")
    mb = weight_bytes / 1e6
    print(f"copy bandwidth {gb_s:.1f} GB/s, {mb:.0f} MB of weights a step; GEMM {gemm}")
    head = ("batch", "native", "vLLM", "native/vLLM", "limit", "native", "vLLM")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (5, 9, 9, 12, 8, 7, 6), strict=True)))
    for b in batches:
        native, vllm = results["native"][b], results["vllm"][b]
        limit = weight_read_limit_tok_s(weight_bytes, b, gb_s)
        rows.append(
            {
                "batch": b,
                "native_tok_s": native,
                "vllm_tok_s": vllm,
                "ratio": native / vllm,
                "limit_tok_s": limit,
                "native_share_of_limit": native / limit,
                "vllm_share_of_limit": vllm / limit,
                "native_prefill_tok_s": prefill["native"][b],
                "vllm_prefill_tok_s": prefill["vllm"][b],
                "prefill_ratio": prefill["native"][b] / prefill["vllm"][b],
            }
        )
        print(
            f"{b:>5} {native:>9.1f} {vllm:>9.1f} {native / vllm:>11.2f}x {limit:>8.1f}"
            f" {native / limit:>7.0%} {vllm / limit:>6.0%}"
        )
    print(f"prefill tok/s ({args.prompt_len}-token prompts, one step for the batch)")
    for r in rows:
        print(
            f"{r['batch']:>5} {r['native_prefill_tok_s']:>9.1f} {r['vllm_prefill_tok_s']:>9.1f}"
            f" {r['prefill_ratio']:>11.2f}x"
        )
    for gguf, (figures, note) in peers.items():
        print(f"llama.cpp {gguf} GGUF ({note}): decode, prefill tok/s; native / llama.cpp")
        for r, f in zip(rows, figures, strict=True):
            r[f"llama_cpp_{gguf}_tok_s"] = f.decode_tok_s
            r[f"llama_cpp_{gguf}_prefill_tok_s"] = f.prefill_tok_s
            r[f"ratio_llama_cpp_{gguf}"] = r["native_tok_s"] / f.decode_tok_s
            print(
                f"{f.batch:>5} {f.decode_tok_s:>9.1f} {f.prefill_tok_s:>9.1f}"
                f" {r['native_tok_s'] / f.decode_tok_s:>7.2f}x"
                f" {r['native_prefill_tok_s'] / f.prefill_tok_s:>7.2f}x"
            )
    report = {
        "benchmark": "offline_engines",
        "llama_cpp": {gguf: note for gguf, (_, note) in peers.items()},
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "copy_gb_s": gb_s,
        "weight_bytes": weight_bytes,
        "native_gemm": gemm,
        "rows": rows,
        "goal_1_3x_vllm": all(r["ratio"] >= 1.3 for r in rows),
        "goal_b1_75pct_of_limit": any(
            r["batch"] == 1 and r["native_share_of_limit"] >= 0.75 for r in rows
        ),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
