"""Offline decode throughput, pdserve's native engine vs vLLM's own ``LLM``, in one run.

Both engines load the same checkpoint, each in a process of its own (vLLM's engine core
in-process there, with its default torch.compile), and decode the same random prompts
greedily, EOS ignored, one engine at a time, taking turns: every repeat runs both, the first
of the pair alternating, so the drift in this box's speed (10-20 % an hour) reaches both
alike. Decode tok/s = batch x (N - 1) / the decode phase of a max_tokens=N run: from the step
that gave every prompt its first token to the last step, timed inside the run (prefill left
out; a difference of two runs, t(N) - t(1), went negative on a loaded box), best of the
repeats. Prefill tok/s is the batch's prompt tokens over a whole max_tokens=1 run (one step:
the prompts, and the first token). Each repeat's own pair gives a ratio too; their median is
printed beside the ratio of the bests. The same run measures this
box's copy bandwidth (benchmarks/memory_limit.py) before every batch and reports each decode
figure as a share of the weight-read limit at the best of those, batch x bandwidth / the
bytes of weights a step reads. Where ``make install-llama-cpp`` has built llama.cpp, the
same run drives its ``llama-batched-bench`` on the same prompt and decode lengths
(benchmarks/llama_cpp.py), on the bf16 GGUF of the same weights and on the Q4_1 GGUF they
came from. Prints the tables with ratios (native / vLLM, native / llama.cpp) and shares, the
native engine's GEMM kernel, then one JSON line. Run in the vLLM environment:

    .venv-vllm/bin/python benchmarks/offline_engines.py [--dtype bfloat16] [--batches 1,8,32]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import llama_cpp  # sibling module
import torch
from bench_inputs import REPO, Timing, greedy_run, make_prompts  # sibling module
from memory_limit import copy_gb_s, decode_weight_bytes, weight_read_limit_tok_s

from app.fetch_model import fetch_model
from app.make_model import make_model
from engine.config import DEFAULT_CPU_KV_CACHE_BYTES
from native_engine import LLM
from native_engine.kernels import small_gemm

QUICK_KV_BYTES = 32 << 20
START_TIMEOUT_S = 900  # vLLM's torch.compile on a loaded 2-core box
RUN_TIMEOUT_S = 900
CLOSE_TIMEOUT_S = 60


# (prompts, max_tokens) -> the run's timing
Runner = Callable[[list[list[int]], int], Timing]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="default: the real SmolLM2")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=65)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument(
        "--quick", action="store_true", help="CI: a tiny model, fp32, batches 1,2, 2 repeats"
    )
    p.add_argument(
        "--llama-cpp",
        type=Path,
        default=llama_cpp.DEFAULT_DIR,
        help="llama.cpp's build (make install-llama-cpp); skipped where absent, and with --quick",
    )
    args = p.parse_args()
    if args.quick:
        args.dtype, args.batches, args.prompt_len, args.new_tokens = "float32", "1,2", 16, 32
        args.repeats = 2
    return args


def native_runner(model: Path, dtype: str, quick: bool, prompt_len: int) -> Runner:
    kv_bytes = QUICK_KV_BYTES if quick else DEFAULT_CPU_KV_CACHE_BYTES
    llm = LLM(str(model), dtype=dtype, block_size=32, kv_cache_bytes=kv_bytes)

    def run(prompts: list[list[int]], n: int) -> Timing:
        return greedy_run(llm, prompts, n)[0]

    return run


def vllm_runner(model: Path, dtype: str, quick: bool, prompt_len: int) -> Runner:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM as VllmLLM
    from vllm import SamplingParams as VllmParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

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

    engine, runs = llm.llm_engine, itertools.count()

    def run(prompts: list[list[int]], n: int) -> Timing:
        # LLM.generate's own loop (add every request, then step to the end, final outputs
        # only), with each step's end timed. Each prompt decodes one token a step once it
        # has its first, so the last prompt's first token came N - 1 steps before the end
        # (prompts prefilled over several steps included).
        params = VllmParams(
            max_tokens=n,
            temperature=0.0,
            ignore_eos=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        tag = next(runs)
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=prompt), params)
        steps: list[float] = []
        finished = []
        while engine.has_unfinished_requests():
            finished.extend(engine.step())
            steps.append(time.perf_counter())
        made = sorted(len(out.outputs[0].token_ids) for out in finished)
        if len(steps) < n or made != [n] * len(prompts):
            raise RuntimeError(f"vLLM: {len(steps)} steps, {made} tokens, for {n} a prompt")
        return Timing(steps[-1] - start, steps[-1] - steps[-n])

    return run


ENGINES: dict[str, Callable[[Path, str, bool, int], Runner]] = {
    "native": native_runner,
    "vllm": vllm_runner,
}


def _engine_main(
    name: str, model: Path, dtype: str, quick: bool, prompt_len: int, conn: Connection
) -> None:
    """A child's loop: build the engine, then time each (prompts, max_tokens) it is sent."""
    run = ENGINES[name](model, dtype, quick, prompt_len)
    conn.send(None)
    while (job := conn.recv()) is not None:
        conn.send(run(*job))


class EngineProcess:
    """One engine in a process of its own, idle between the jobs the parent sends it, so each
    runs as it would alone yet the two take turns within one run. In one process (vLLM pins
    the OpenMP threads of the process it starts in) both ran slower: fp32 at batch 8, native
    207 against 222 tok/s, vLLM 156 against 173. The timings are taken in the child, around
    the engine's own run alone. A context manager: leaving it stops the child."""

    def __init__(self, name: str, model: Path, args: argparse.Namespace) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.name = name
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_engine_main,
            args=(name, model, args.dtype, args.quick, args.prompt_len, child),
            daemon=True,
        )
        self._proc.start()
        child.close()  # the child's end is the child's alone: its death reads as EOF here
        try:
            self._receive(START_TIMEOUT_S, "start")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _receive(self, timeout_s: float, what: str) -> Any:
        """The child's next message, waited for with a bound; a dead child is named."""
        if not wait([self._conn, self._proc.sentinel], timeout_s):
            raise TimeoutError(f"{self.name} did not {what} in {timeout_s} s")
        try:
            return self._conn.recv()
        except EOFError:
            self._proc.join(CLOSE_TIMEOUT_S)
            raise RuntimeError(
                f"{self.name} exited (code {self._proc.exitcode}) before it could {what}"
            ) from None

    def run(self, prompts: list[list[int]], max_tokens: int) -> Timing:
        self._conn.send((prompts, max_tokens))
        timing: Timing = self._receive(RUN_TIMEOUT_S, "finish a run")
        return timing

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a child already gone
            self._conn.send(None)
        self._proc.join(CLOSE_TIMEOUT_S)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()


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


@dataclass(frozen=True)
class Figures:
    """One engine at one batch."""

    decode_tok_s: float  # from the best decode phase of the repeats' max_tokens=N runs
    prefill_tok_s: float  # the batch's prompt tokens over the best max_tokens=1 run
    per_repeat: tuple[float, ...]  # each repeat's own decode tok/s, in order


def measure(
    runs: dict[str, Runner], batch: int, args: argparse.Namespace, vocab: int
) -> dict[str, Figures]:
    """Every engine at one batch, taking turns at each repeat (the first alternating)."""

    def prompts(seed: int) -> list[list[int]]:
        return make_prompts(seed, batch, args.prompt_len, vocab)

    for run in runs.values():
        run(prompts(batch), 4)  # warm-up: compiles, first-touch pages
    decode: dict[str, list[float]] = {name: [] for name in runs}
    first: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.repeats):
        for name in list(runs) if r % 2 == 0 else list(reversed(runs)):
            decode[name].append(
                runs[name](prompts(100 * batch + r), args.new_tokens).decode_seconds
            )
            first[name].append(runs[name](prompts(200 * batch + r), 1).seconds)
    tokens = batch * (args.new_tokens - 1)
    return {
        name: Figures(
            tokens / min(decode[name]),
            batch * args.prompt_len / min(first[name]),
            tuple(tokens / d for d in decode[name]),
        )
        for name in runs
    }


def main() -> None:
    args = parse_args()
    if args.quick:  # vLLM's CPU attention needs head_dim 64: tiny64
        model = make_model(Path(tempfile.mkdtemp()) / "tiny64", "llama", "tiny64")
    else:
        model, _ = fetch_model("smollm2", args.model or REPO / "models" / "smollm2-135m-instruct")
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    batches = [int(b) for b in args.batches.split(",")]
    bandwidths: list[float] = []
    measured: dict[int, dict[str, Figures]] = {}
    with contextlib.ExitStack() as stack:
        engines = [stack.enter_context(EngineProcess(name, model, args)) for name in ENGINES]
        runs: dict[str, Runner] = {e.name: e.run for e in engines}
        for b in batches:
            bandwidths.append(copy_gb_s(size_bytes=QUICK_KV_BYTES if args.quick else None))
            measured[b] = measure(runs, b, args, vocab)
    peers = {} if args.quick or not llama_cpp.available(args.llama_cpp) else llama_peers(args)
    gb_s = max(bandwidths)
    weight_bytes = decode_weight_bytes(model, 2 if args.dtype == "bfloat16" else 4)
    isa = small_gemm.chosen(getattr(torch, args.dtype))
    gemm = isa.name if isa is not None else "onednn"
    rows: list[dict[str, Any]] = []
    print(f"offline decode tok/s, {args.dtype}, {args.prompt_len}-token prompts, greedy")
    mb = weight_bytes / 1e6
    print(
        f"copy bandwidth {gb_s:.1f} GB/s (best of {min(bandwidths):.1f}-{gb_s:.1f}), "
        f"{mb:.0f} MB of weights a step; GEMM {gemm}"
    )
    head = ("batch", "native", "vLLM", "native/vLLM", "pair median", "limit", "native", "vLLM")
    widths = (5, 9, 9, 12, 12, 8, 7, 6)
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, widths, strict=True)))
    for b in batches:
        native, vllm = measured[b]["native"], measured[b]["vllm"]
        pairs = [n / v for n, v in zip(native.per_repeat, vllm.per_repeat, strict=True)]
        limit = weight_read_limit_tok_s(weight_bytes, b, gb_s)
        rows.append(
            {
                "batch": b,
                "native_tok_s": native.decode_tok_s,
                "vllm_tok_s": vllm.decode_tok_s,
                "ratio": native.decode_tok_s / vllm.decode_tok_s,
                "pair_ratios": pairs,
                "median_pair_ratio": statistics.median(pairs),
                "limit_tok_s": limit,
                "native_share_of_limit": native.decode_tok_s / limit,
                "vllm_share_of_limit": vllm.decode_tok_s / limit,
                "native_prefill_tok_s": native.prefill_tok_s,
                "vllm_prefill_tok_s": vllm.prefill_tok_s,
                "prefill_ratio": native.prefill_tok_s / vllm.prefill_tok_s,
            }
        )
        r = rows[-1]
        print(
            f"{b:>5} {r['native_tok_s']:>9.1f} {r['vllm_tok_s']:>9.1f} {r['ratio']:>11.2f}x"
            f" {r['median_pair_ratio']:>11.2f}x {limit:>8.1f}"
            f" {r['native_share_of_limit']:>7.0%} {r['vllm_share_of_limit']:>6.0%}"
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
        "copy_gb_s_each_batch": bandwidths,
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
