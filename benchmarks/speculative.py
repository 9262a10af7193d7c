"""Speculative decoding: decode tok/s with and without it, same run, same prompts (CPU).

For each model (the random-init ``small`` bench checkpoint; the real chat model SmolLM2-135M
-Instruct when ``models/smollm2-135m-instruct`` is present, from ``pdserve fetch-model``), each
workload, each batch size and each speculation setting, the same prompts run through a plain
engine and a speculating one, interleaved, best of ``--repeats``:

- (a) copy: the answer repeats a passage of the prompt (chat model: "Repeat the following text
  word for word"; the random model: a prompt made of one random passage said twice);
- (b) random: random token ids; on the chat model also (c) novel: open-ended questions whose
  answers are new text. Guesses there mostly fail, and adaptivity must keep the cost down:
  ``ngram(no-adapt)`` (min acceptance 0, no batch limit) shows, same run, what it saves.

Decode tok/s = generated tokens after the first / the decode phase's time
(``bench_inputs.decode_phase``: from the step that gave every prompt its first token to the
last token, no prefill in it). The outputs of both engines are compared token for token (they
must be equal; speculation changes speed only). Also reported: acceptance rate (kept / proposed
guesses) and tokens per verifying step. Ends with one JSON line. ``--quick``: tiny model, a
seconds-long smoke run.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from bench_inputs import REPO, decode_phase, ensure_model  # sibling module

from engine import SamplingParams
from native_engine import LLM

CHAT_MODEL = REPO / "models" / "smollm2-135m-instruct"
_WORDS = [
    "river",
    "stone",
    "light",
    "garden",
    "winter",
    "market",
    "silver",
    "window",
    "harbor",
    "forest",
    "letter",
    "candle",
    "mountain",
    "paper",
    "engine",
    "orchard",
    "bridge",
    "lantern",
    "meadow",
    "copper",
    "island",
    "thunder",
    "pillow",
    "quiet",
    "golden",
    "ancient",
    "narrow",
    "bright",
    "gentle",
    "hollow",
    "rapid",
    "distant",
    "humble",
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated (1,8)")
    p.add_argument("--new-tokens", type=int, default=96, help="max tokens per request (96)")
    p.add_argument("--k", type=int, default=4, help="speculative tokens per step (4)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs, best kept (2)")
    p.add_argument("--size", choices=("tiny", "small"), default="small")
    p.add_argument("--model", type=Path, help="random checkpoint (default models/bench-llama-*)")
    p.add_argument("--no-chat", action="store_true", help="skip the real chat model")
    p.add_argument("--quick", action="store_true", help="tiny model, batch 1 and 2, 8 tokens")
    args = p.parse_args()
    if args.quick:
        args.batch_sizes, args.new_tokens, args.repeats, args.size = "1,2", 12, 1, "tiny"
        args.no_chat = True
    args.batches = [int(b) for b in args.batch_sizes.split(",")]
    return args


def passage(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(num_words)).capitalize() + "."


def chat_prompts(llm: LLM, workload: str, batch: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    tokenizer = llm.engine.tokenizer
    assert tokenizer is not None
    if workload == "random":
        return [[rng.randrange(100, 49000) for _ in range(48)] for _ in range(batch)]
    prompts = []
    for _ in range(batch):
        if workload == "novel":
            a, b = rng.choice(_WORDS), rng.choice(_WORDS)
            text = f"Write a short story about a {a} and a {b}."
        else:
            text = f"Repeat the following text word for word:\n\n{passage(rng, 40)}"
        chat = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
        prompts.append(tokenizer.encode(chat))
    return prompts


def random_model_prompts(vocab: int, workload: str, batch: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(batch):
        part = [rng.randrange(3, vocab) for _ in range(32)]
        if workload == "copy":
            out.append(part + part)  # a passage said twice: the model may say it a third time
        else:
            out.append(part + [rng.randrange(3, vocab) for _ in range(32)])
    return out


def timed(llm: LLM, prompts: list[list[int]], n: int, eos: bool) -> tuple[float, list[list[int]]]:
    """The decode phase's seconds (``bench_inputs.decode_phase``) and the outputs."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=not eos)
    seconds, outputs = decode_phase(llm, prompts, [params] * len(prompts))
    return seconds, [o.token_ids for o in outputs]


def measure(
    plain: LLM, spec: LLM, prompts_for: Any, batch: int, args: argparse.Namespace, eos: bool
) -> dict[str, Any]:
    best = {"plain": float("inf"), "spec": float("inf")}
    tokens = 0
    for llm in (plain, spec):  # warm-up (allocator, kernels): not timed
        timed(llm, prompts_for(batch, 999_999), 4, eos)
    before = spec.engine.stats()
    for repeat in range(args.repeats):
        prompts = prompts_for(batch, 1000 * repeat + batch)  # fresh: no prefix-cache hits
        results = {}
        for name, llm in (("plain", plain), ("spec", spec)):
            decode_s, out = timed(llm, prompts, args.new_tokens, eos)
            results[name] = out
            best[name] = min(best[name], decode_s)
        assert results["plain"] == results["spec"], "speculation changed the output"
        tokens = sum(len(t) - 1 for t in results["plain"])
    after = spec.engine.stats()
    proposed = after.num_spec_proposed_tokens - before.num_spec_proposed_tokens
    accepted = after.num_spec_accepted_tokens - before.num_spec_accepted_tokens
    verifications = after.num_spec_verifications - before.num_spec_verifications
    plain_tps, spec_tps = tokens / best["plain"], tokens / best["spec"]
    return {
        "batch": batch,
        "decode_tokens": tokens,
        "plain_tok_s": round(plain_tps, 1),
        "spec_tok_s": round(spec_tps, 1),
        "speedup": round(spec_tps / plain_tps, 3),
        "acceptance": round(accepted / proposed, 3) if proposed else None,
        "tokens_per_step": round(1 + accepted / verifications, 2) if verifications else None,
    }


def run_model(name: str, model: Path, chat: bool, args: argparse.Namespace) -> list[dict[str, Any]]:
    plain = LLM(str(model))
    vocab = plain.engine.model_config.vocab_size
    settings: list[tuple[str, dict[str, Any]]] = [
        ("ngram", {"speculative_method": "ngram"}),
        (
            "ngram(no-adapt)",
            {
                "speculative_method": "ngram",
                "spec_min_acceptance": 0.0,
                "spec_max_batch_size": 1024,
            },
        ),
    ]
    if not chat:  # the target as its own draft: the acceptance ceiling, at a draft's full cost
        settings.append(
            ("draft(self)", {"speculative_method": "draft", "spec_draft_model": str(model)})
        )
    workloads = ("copy", "random", "novel") if chat else ("copy", "random")
    rows = []
    for setting, kwargs in settings:
        spec = LLM(str(model), num_speculative_tokens=args.k, **kwargs)
        for workload in workloads:
            if setting != "ngram" and (workload == "copy") == setting.endswith("no-adapt)"):
                continue  # no-adapt: where guesses fail; a self-draft: (a) shows it

            def prompts_for(batch: int, seed: int, workload: str = workload) -> list[list[int]]:
                if chat:
                    return chat_prompts(plain, workload, batch, seed)
                return random_model_prompts(vocab, workload, batch, seed)

            for batch in args.batches:
                row = measure(plain, spec, prompts_for, batch, args, eos=chat)
                row.update(model=name, method=setting, workload=workload)
                rows.append(row)
                print(
                    f"{name:<8} {setting:<16} {workload:<7} batch {batch:>2}: "
                    f"plain {row['plain_tok_s']:>7.1f} tok/s, spec {row['spec_tok_s']:>7.1f} "
                    f"tok/s ({row['speedup']:.2f}x), acceptance {row['acceptance']}, "
                    f"tokens/step {row['tokens_per_step']}",
                    flush=True,
                )
    return rows


def main() -> None:
    args = parse_args()
    rows = run_model(args.size, ensure_model(args), chat=False, args=args)
    if not args.no_chat and (CHAT_MODEL / "config.json").is_file():
        rows += run_model("smollm2", CHAT_MODEL, chat=True, args=args)
    elif not args.no_chat:
        print(f"(no chat model at {CHAT_MODEL}: `pdserve fetch-model smollm2 {CHAT_MODEL}`)")
    print(json.dumps({"benchmark": "speculative", "k": args.k, "rows": rows}))


if __name__ == "__main__":
    main()
