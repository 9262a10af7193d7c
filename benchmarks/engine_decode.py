"""Decode and prefill throughput: pdserve engine vs HF transformers vs a GEMM roofline (CPU).

Every number comes from one process and one checkpoint (random-init Llama, float32, built with
``app.make_model`` into ``models/bench-llama-<size>`` when missing):

- Decode tok/s (engine and HF alike): ``batch * (N - 1) / decode_seconds`` with 64-token random
  prompts and greedy, EOS-free generation. ``decode_seconds`` runs from the moment every prompt
  has its first token to the last token, timed inside one run (the engine's own token times;
  a streamer on HF's ``generate``): exactly N - 1 decode steps, no prefill. (A difference of two
  runs, t(N) - t(1), went negative on a loaded machine.) Best of ``--repeats`` runs, engine and
  HF interleaved; each run uses fresh prompts (no prefix-cache hits), and the same prompts go
  to both, so their greedy tokens are compared too.
- Prefill tok/s: one ``--prefill-len`` prompt, ``max_tokens=1``, best of ``--repeats``.
- Roofline: one decode step's matmuls alone (``F.linear`` over HF's unfused weight shapes: per
  layer q, k, v, o, gate, up, down; lm_head once) at the same batch: ``batch / step_time``.

Ends with a single JSON line holding every number. ``--quick`` is a seconds-long smoke run on
the tiny model.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from bench_inputs import REPO, Timing, ensure_model, greedy_run, make_prompts  # sibling module
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.generation.streamers import BaseStreamer

from engine.dtypes import DTYPE_NAMES, ModelDtype
from native_engine import LLM
from native_engine.models.linear import Linear

BLOCK_SIZE = 16
FULL = {
    "batch_sizes": "1,8,32",
    "prompt_len": 64,
    "new_tokens": 128,
    "prefill_len": 1024,
    "repeats": 3,
    "size": "small",
}
QUICK = {
    "batch_sizes": "1,2",
    "prompt_len": 16,
    "new_tokens": 16,
    "prefill_len": 64,
    "repeats": 2,
    "size": "tiny",
}


# (prompts, max_new_tokens) -> the run's timing, and the generated token ids per prompt
Runner = Callable[[list[list[int]], int], tuple[Timing, list[list[int]]]]


class DecodeClock(BaseStreamer):
    """Times HF's decode phase: ``generate`` puts the prompt, then each step's new tokens."""

    def __init__(self) -> None:
        self.puts = 0
        self.first = self.last = 0.0

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        self.puts += 1
        if self.puts == 2:  # the first generated tokens (put 1 is the prompt)
            self.first = now
        self.last = now

    def end(self) -> None:
        return None


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--batch-sizes", help=f"comma-separated (default {FULL['batch_sizes']})")
    p.add_argument("--prompt-len", type=int, help="decode prompt tokens (default 64)")
    p.add_argument("--new-tokens", type=int, help="generated tokens per request (default 128)")
    p.add_argument("--prefill-len", type=int, help="prefill prompt tokens (default 1024)")
    p.add_argument("--repeats", type=int, help="timed runs per measurement, best kept (3)")
    p.add_argument("--size", choices=("tiny", "small"), help="checkpoint size (default small)")
    p.add_argument("--model", type=Path, help="HF checkpoint dir (default models/bench-llama-*)")
    p.add_argument("--quick", action="store_true", help="tiny model and sizes (CI smoke)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", default="float32", choices=DTYPE_NAMES, help="default float32")
    args = p.parse_args()
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.new_tokens < 2 or args.prompt_len < 1 or args.prefill_len < 1 or args.repeats < 1:
        p.error("need --new-tokens >= 2 and --prompt-len, --prefill-len, --repeats >= 1")
    return args


def engine_runner(llm: LLM) -> Runner:
    def run(prompts: list[list[int]], n: int) -> tuple[Timing, list[list[int]]]:
        timing, outputs = greedy_run(llm, prompts, n)
        tokens = [o.token_ids for o in outputs]
        assert all(len(t) == n for t in tokens), "engine generated the wrong number of tokens"
        return timing, tokens

    return run


def hf_runner(model: PreTrainedModel, pad_id: int) -> Runner:
    # Like the engine's ignore_eos: EOS is a token like any other. (``min_new_tokens`` would
    # instead mask EOS out of the logits, and greedy would then differ wherever EOS wins.)
    model.generation_config.eos_token_id = None

    def run(prompts: list[list[int]], n: int) -> tuple[Timing, list[list[int]]]:
        clock = DecodeClock()
        ids = torch.tensor(prompts, dtype=torch.long, device=model.device)
        mask = torch.ones_like(ids)
        with torch.inference_mode():
            start = time.perf_counter()
            out = model.generate(  # type: ignore[operator]
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                do_sample=False,
                pad_token_id=pad_id,
                streamer=clock,
            )
            elapsed = time.perf_counter() - start
        tokens: list[list[int]] = out[:, ids.shape[1] :].tolist()
        assert all(len(t) == n for t in tokens), "HF generated the wrong number of tokens"
        return Timing(elapsed, clock.last - clock.first), tokens

    return run


def gemm_shapes(cfg: dict[str, Any]) -> list[tuple[int, int]]:
    """(out_features, in_features) of one decode step's matmuls, HF's unfused projections."""
    hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    head_dim = int(cfg.get("head_dim") or hidden // int(cfg["num_attention_heads"]))
    q, kv = int(cfg["num_attention_heads"]) * head_dim, int(cfg["num_key_value_heads"]) * head_dim
    layer = [
        (q, hidden),
        (kv, hidden),
        (kv, hidden),
        (hidden, q),
        (inter, hidden),
        (inter, hidden),
        (hidden, inter),
    ]
    return layer * int(cfg["num_hidden_layers"]) + [(int(cfg["vocab_size"]), hidden)]


def roofline_step_seconds(
    matmuls: list[Callable[[torch.Tensor], torch.Tensor]],
    in_features: list[int],
    batch: int,
    chunks: int,
    chunk_seconds: float,
    device: torch.device,
    dtype: torch.dtype,
) -> float:
    """Best per-step time of the matmuls alone, over ``chunks`` timed chunks of many steps."""
    inputs = {k: torch.randn(batch, k, device=device, dtype=dtype) for k in set(in_features)}

    def step() -> None:
        for matmul, k in zip(matmuls, in_features, strict=True):
            matmul(inputs[k])
        if device.type == "cuda":
            torch.cuda.synchronize()

    with torch.inference_mode():
        step()
        start = time.perf_counter()
        step()
        reps = max(3, int(chunk_seconds / max(time.perf_counter() - start, 1e-6)))
        best = float("inf")
        for _ in range(chunks):
            start = time.perf_counter()
            for _ in range(reps):
                step()
            best = min(best, (time.perf_counter() - start) / reps)
    return best


def roofline_matmuls(
    shapes: list[tuple[int, int]], device: torch.device, dtype: torch.dtype, packed: bool
) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """Plain ``F.linear`` (the spec's roofline), or the engine's own GEMM layer (prepacked)."""
    matmuls: list[Callable[[torch.Tensor], torch.Tensor]] = []
    for out_features, in_features in shapes:
        weight = torch.randn(out_features, in_features, device=device, dtype=dtype)
        if not packed:
            matmuls.append(functools.partial(F.linear, weight=weight))
            continue
        layer = Linear(out_features, in_features, dtype)
        layer.weight.data = weight
        layer.prepack()
        matmuls.append(layer)
    return matmuls


def measure_decode(
    runners: dict[str, Runner], batch: int, args: argparse.Namespace, vocab: int
) -> dict[str, Any]:
    n, seed = args.new_tokens, 1000 * batch

    def prompts(k: int) -> list[list[int]]:
        return make_prompts(seed + k, batch, args.prompt_len, vocab)

    for run in runners.values():
        run(prompts(0), n)  # warm-up
    decode: dict[str, list[float]] = {name: [] for name in runners}
    tokens: dict[str, list[list[int]]] = {}
    for rep in range(args.repeats):
        for name, run in runners.items():  # interleaved: load drift hits both alike
            timing, tokens[name] = run(prompts(rep + 1), n)
            decode[name].append(timing.decode_seconds)
    result: dict[str, Any] = {"batch": batch}
    for name in runners:
        step = min(decode[name]) / (n - 1)
        result[f"{name}_step_ms"] = 1e3 * step
        result[f"{name}_tok_s"] = batch / step
    same = sum(a == b for a, b in zip(tokens["engine"], tokens["hf"], strict=True))
    result["greedy_match"] = same / batch
    return result


def measure_prefill(
    runners: dict[str, Runner], args: argparse.Namespace, vocab: int
) -> dict[str, float]:
    result: dict[str, float] = {"tokens": args.prefill_len}
    for run in runners.values():
        run(make_prompts(7, 1, args.prefill_len, vocab), 1)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in runners}
    for rep in range(args.repeats):
        prompt = make_prompts(8 + rep, 1, args.prefill_len, vocab)
        for name, run in runners.items():  # interleaved, like decode
            times[name].append(run(prompt, 1)[0].seconds)
    for name, elapsed in times.items():
        result[f"{name}_tok_s"] = args.prefill_len / min(elapsed)
    result["ratio"] = result["engine_tok_s"] / result["hf_tok_s"]
    return result


def print_table(report: dict[str, Any]) -> None:
    print(
        f"\nmodel {report['model']} ({report['dtype']}, {report['device']}, "
        f"{report['threads']} threads); decode: "
        f"{report['prompt_len']}-token prompts, {report['new_tokens']} new tokens, greedy; "
        f"best of {report['repeats']}"
    )
    header = (
        f"{'batch':>5} {'engine tok/s':>13} {'HF tok/s':>10} {'eng/HF':>7} "
        f"{'roofline tok/s':>15} {'eng/roof':>9} {'HF/roof':>8} "
        f"{'packed roof':>12} {'eng/packed':>11} {'greedy=':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in report["decode"]:
        print(
            f"{r['batch']:>5} {r['engine_tok_s']:>13.1f} {r['hf_tok_s']:>10.1f} "
            f"{r['engine_over_hf']:>6.2f}x {r['roofline_tok_s']:>15.1f} "
            f"{r['engine_over_roofline']:>8.1%} {r['hf_over_roofline']:>8.1%} "
            f"{r['packed_roofline_tok_s']:>12.1f} {r['engine_over_packed_roofline']:>10.1%} "
            f"{r['greedy_match']:>8.0%}"
        )
    pf = report["prefill"]
    print(
        f"\nprefill ({pf['tokens']}-token prompt): engine {pf['engine_tok_s']:.1f} tok/s, "
        f"HF {pf['hf_tok_s']:.1f} tok/s, engine/HF {pf['ratio']:.2f}x\n"
    )


def main() -> None:
    args = parse_args()
    model_dir = ensure_model(args)
    cfg: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    vocab = int(cfg["vocab_size"])
    batch_sizes = [int(b) for b in str(args.batch_sizes).split(",")]
    per_seq = -(-(args.prompt_len + args.new_tokens) // BLOCK_SIZE)
    # Sized to the workload (the default CPU budget is a 2 GiB cache this run never touches).
    num_blocks = 2 * max(max(batch_sizes) * per_seq, -(-(args.prefill_len + 1) // BLOCK_SIZE))
    device, dtype = torch.device(args.device), ModelDtype(args.dtype).as_torch
    llm = LLM(
        str(model_dir),
        dtype=args.dtype,
        device=args.device,
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        max_num_batched_tokens=max(2048, args.prefill_len),
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    hf.to(device)  # type: ignore[arg-type]
    hf.eval()
    runners = {"engine": engine_runner(llm), "hf": hf_runner(hf, int(cfg["pad_token_id"]))}
    shapes = gemm_shapes(cfg)
    in_features = [i for _, i in shapes]
    rooflines = {
        "roofline": roofline_matmuls(shapes, device, dtype, packed=False),
        "packed_roofline": roofline_matmuls(shapes, device, dtype, packed=True),
    }
    chunk_seconds = 0.02 if args.quick else 0.3

    decode: list[dict[str, Any]] = []
    for batch in batch_sizes:
        print(f"decode batch {batch} ...", flush=True)
        r = measure_decode(runners, batch, args, vocab)
        for name, matmuls in rooflines.items():
            roof = roofline_step_seconds(
                matmuls, in_features, batch, max(3, args.repeats), chunk_seconds, device, dtype
            )
            r[f"{name}_step_ms"] = 1e3 * roof
            r[f"{name}_tok_s"] = batch / roof
            r[f"engine_over_{name}"] = r["engine_tok_s"] / r[f"{name}_tok_s"]
        r["engine_over_hf"] = r["engine_tok_s"] / r["hf_tok_s"]
        r["hf_over_roofline"] = r["hf_tok_s"] / r["roofline_tok_s"]
        decode.append(r)
    print("prefill ...", flush=True)
    report: dict[str, Any] = {
        "model": str(model_dir.relative_to(REPO) if model_dir.is_relative_to(REPO) else model_dir),
        "dtype": args.dtype,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "decode_method": "first token to last, in one run, / (N - 1); best of repeats",
        "decode": decode,
        "prefill": measure_prefill(runners, args, vocab),
    }
    print_table(report)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
