"""The ``pdserve`` command line: the only place that reads argv and the environment."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence

DEMO_PROMPTS = (
    "The weather today is",
    "To cook rice, first",
    "Computers store numbers as",
)


def _cmd_make_model(args: argparse.Namespace) -> int:
    from pdserve.make_model import make_model

    path = make_model(args.dir, args.arch, args.size, args.seed, dtype=args.dtype)
    print(f"wrote {args.arch}/{args.size} checkpoint to {path}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams

    print(
        "loading the engine (the first run on a machine also compiles the CPU attention "
        "kernel, ~20 s) ...",
        flush=True,
    )
    engine = LLMEngine(
        EngineConfig(model=args.model, dtype=args.dtype, cache=CacheConfig(block_size=16))
    )
    print(f"attention backend: {engine.attention_backend.value}")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.95, seed=0)
    for prompt in DEMO_PROMPTS:
        engine.add_request(prompt, params)
        start = time.perf_counter()
        first_token_s: float | None = None
        num_tokens = 0
        print(f"\n>>> {prompt}", end="", flush=True)
        while engine.has_unfinished_requests():
            for update in engine.step():
                if update.new_token_ids and first_token_s is None:
                    first_token_s = time.perf_counter() - start
                num_tokens += len(update.new_token_ids)
                print(update.new_text, end="", flush=True)
        total_s = time.perf_counter() - start
        ttft = first_token_s or total_s
        tpot = (total_s - ttft) / max(num_tokens - 1, 1)
        print(f"\n    [{num_tokens} tokens, TTFT {ttft * 1e3:.1f} ms, TPOT {tpot * 1e3:.2f} ms]")
    engine.block_manager.check_no_leaks()
    print("\n(random-weight demo model: the text is gibberish by design)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument(
        "--log-level",
        default=os.environ.get("PDSERVE_LOG_LEVEL", "WARNING"),
        help="logging level (env PDSERVE_LOG_LEVEL)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    make = sub.add_parser("make-model", help="write a random-init HF checkpoint + tokenizer")
    make.add_argument("dir")
    make.add_argument("--arch", choices=("llama", "qwen2", "qwen3"), default="llama")
    make.add_argument("--size", choices=("tiny", "small"), default="tiny")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    make.set_defaults(func=_cmd_make_model)

    demo = sub.add_parser("demo", help="stream generations from the offline engine")
    demo.add_argument(
        "--model",
        default=os.environ.get("PDSERVE_MODEL"),
        required="PDSERVE_MODEL" not in os.environ,
        help="model directory (env PDSERVE_MODEL)",
    )
    demo.add_argument("--dtype", default=os.environ.get("PDSERVE_DTYPE", "float32"))
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        result: int = args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    return result


if __name__ == "__main__":
    sys.exit(main())
