"""KV cache tiers and dtypes. (a) A multi-turn workload whose prefixes exceed the device cache,
host tier off vs on, same run, same prompts (CPU: both tiers are DRAM, so the gain is prompt
tokens not recomputed, and the TTFT that saves). (b) The cache dtype: float32 / bfloat16 vs int8
vs fp8_e4m3 on the real chat model when it is cached (``benchmarks/kv_dtypes.py``).

Each of ``--conversations`` conversations runs ``--turns`` turns; turn t's prompt is turn t-1's
prompt, its answer and ``--turn-tokens`` new tokens. Requests run one at a time (TTFT is the
engine's own time to the first token), round-robin over the conversations, so by the time a
conversation comes back its prefix has been evicted from a device cache of ``--device-blocks``.
Reported per setting: prompt tokens computed, host-tier hit tokens, TTFT p50/p90 of turns >= 2,
and whether both settings produced the same tokens. Goal (a): >= 2x fewer prompt tokens and a
lower TTFT p90. Goal (b): int8 and fp8 at <= 0.55x the bfloat16 bytes per token (scales
included), transfer time cut accordingly, at >= 95 % teacher-forced greedy agreement on the real
model. Ends with one JSON line; ``--quick`` is a seconds-long smoke run on the tiny model.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench_inputs import REPO, ensure_model  # sibling modules
from kv_dtypes import measure_dtypes

from engine import SamplingParams
from native_engine import LLM

CHAT_MODEL = REPO / "models" / "smollm2-135m-instruct"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--first-tokens", type=int, default=384, help="first prompt length (384)")
    p.add_argument("--turn-tokens", type=int, default=64, help="new tokens per turn (64)")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--device-blocks", type=int, default=96, help="device cache, 16-token blocks")
    p.add_argument("--host-cache-gib", type=float, default=1.0)
    p.add_argument("--size", choices=("tiny", "small"), default="small")
    p.add_argument("--model", type=Path)
    p.add_argument("--part", choices=("a", "b", "all"), default="all")
    p.add_argument("--chat-model", type=Path, default=CHAT_MODEL, help="(b): the real model")
    p.add_argument("--transfer-tokens", type=int, default=2048, help="(b): prompt moved (2048)")
    p.add_argument("--transfer-repeats", type=int, default=15)
    p.add_argument("--agreement-tokens", type=int, default=64)
    p.add_argument("--cache-mib", type=int, default=512, help="(b): the fixed cache (512 MiB)")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.conversations, args.turns, args.first_tokens, args.size = 4, 2, 64, "tiny"
        args.turn_tokens, args.output_tokens, args.device_blocks = 16, 4, 12
        args.host_cache_gib = 0.05
        args.transfer_tokens, args.transfer_repeats, args.agreement_tokens = 128, 1, 16
        args.cache_mib, args.chat_model = 8, None
    return args


def run(llm: LLM, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [
        [rng.randrange(3, vocab) for _ in range(args.first_tokens)]
        for _ in range(args.conversations)
    ]
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    ttfts: list[float] = []
    outputs: list[list[int]] = []
    for turn in range(args.turns):
        for c, prompt in enumerate(prompts):
            start = time.perf_counter()
            request_id = engine.add_request(prompt, params)
            tokens: list[int] = []
            first = None
            while engine.has_unfinished_requests():
                for update in engine.step():
                    if update.request_id == request_id:
                        if first is None and update.new_token_ids:
                            first = time.perf_counter() - start
                        tokens.extend(update.new_token_ids)
            if turn:
                assert first is not None
                ttfts.append(first)
            outputs.append(tokens)
            new = [rng.randrange(3, vocab) for _ in range(args.turn_tokens)]
            prompts[c] = prompt + tokens + new
    stats = engine.stats()
    ttfts.sort()
    return {
        "prompt_tokens_computed": stats.num_prompt_tokens_computed,
        "host_hit_tokens": stats.num_host_hit_tokens,
        "prefix_hit_tokens": stats.num_prefix_hit_tokens,
        "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
        "ttft_p90_ms": round(1000 * ttfts[int(0.9 * (len(ttfts) - 1))], 1),
        "outputs": outputs,
    }


def part_a(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    results = {}
    for name, gib in (("off", 0.0), ("host", args.host_cache_gib)):
        llm = LLM(str(model), num_blocks=args.device_blocks, host_cache_gib=gib)
        results[name] = run(llm, args)
        r = results[name]
        print(
            f"host tier {name:<4}: prompt tokens computed {r['prompt_tokens_computed']:>7}, "
            f"host hits {r['host_hit_tokens']:>7}, TTFT p50 {r['ttft_p50_ms']:>7.1f} ms, "
            f"p90 {r['ttft_p90_ms']:>7.1f} ms",
            flush=True,
        )
    same = results["off"].pop("outputs") == results["host"].pop("outputs")
    off, on = results["off"], results["host"]
    ratio = off["prompt_tokens_computed"] / max(on["prompt_tokens_computed"], 1)
    print(f"prompt tokens computed: {ratio:.2f}x fewer with the host tier; same tokens: {same}")
    return {"same_tokens": same, "prompt_tokens_ratio": round(ratio, 2), **results}


def part_b(args: argparse.Namespace) -> dict[str, Any]:
    chat = args.chat_model is not None and (args.chat_model / "config.json").is_file()
    model = args.chat_model if chat else ensure_model(args)
    args.chat = chat
    print(f"(b) cache dtypes on {model.name}; {args.transfer_tokens}-token transfer (gRPC)")
    rows = measure_dtypes(model, args)
    for name, r in rows.items():
        line = (
            f"  {name:<9} {r['bytes_per_token']:>7} B/token"
            f" ({r.get('vs_bf16_bytes', '-')}x bf16), transfer {r['transfer_ms']:>8.2f} ms"
            f" ({r.get('vs_bf16_transfer', '-')}x bf16), {r['max_concurrent_seqs']:>4} seqs"
        )
        if "agreement" in r:
            line += (
                f", agreement {r['agreement']:.3f} (min {r['min_prompt_agreement']:.3f}, first"
                f" divergence {r['first_divergence']}), max logit error {r['max_logit_error']}"
            )
        print(line, flush=True)
    return {"model": model.name, "chat": chat, "dtypes": rows}


def main() -> None:
    args = parse_args()
    report: dict[str, Any] = {"benchmark": "kv_tiers"}
    if args.part in ("a", "all"):
        report.update(part_a(ensure_model(args), args))
    if args.part in ("b", "all"):
        report["kv_cache_dtype"] = part_b(args)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
