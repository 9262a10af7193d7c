"""Structured outputs: what a grammar costs per token, and llguidance against xgrammar.

1. **TPOT with and without a JSON schema** on the engine (real SmolLM2 by default), batch 1 and
   16, greedy. The guided run goes first; the plain run then generates exactly as many tokens
   per request (``max_tokens`` = the guided length, ``ignore_eos``), so both runs step the same
   batch for the same number of steps. TPOT = the decode phase's time (``bench_inputs.
   decode_phase``: from every request's first token to the last) / (steps - 1), best of
   ``--repeats``; the ratio guided / plain is the mask's cost (goal <= 1.10).
2. **The two grammar engines on the same schemas**, single-threaded, on the same tokenizer:
   the token table build, compile time (xgrammar: ``compile_json_schema`` with its cache off;
   llguidance: the matcher's construction plus its first mask, since it compiles lazily), and
   the mask cost per token while walking a valid instance's tokens (mean, p50, max).

Prints tables and ratios, then one JSON line. ``--quick``: the tiny random model, batch 1 and
2, few tokens (a smoke run: the numbers mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from bench_inputs import REPO, decode_phase  # sibling module

from engine import SamplingParams
from engine.structured_output import StructuredKind, StructuredOutput
from native_engine import LLM

CHAT_MODEL = REPO / "models" / "smollm2-135m-instruct"
LIST_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "items": {"type": "array", "items": {"type": "string", "maxLength": 60}},
    },
    "required": ["title", "items"],
    "additionalProperties": False,
}
# (name, schema, a valid instance) for the engines' comparison.
SCHEMAS: list[tuple[str, dict[str, Any], Any]] = [
    (
        "person",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0},
                "email": {"type": "string", "format": "email"},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            },
            "required": ["name", "age", "email", "tags"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "poetry"]},
    ),
    (
        "order",
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
                "status": {"enum": ["pending", "paid", "shipped"]},
                "lines": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string"},
                            "qty": {"type": "integer", "minimum": 1},
                            "price": {"type": "number"},
                        },
                        "required": ["sku", "qty", "price"],
                    },
                },
                "address": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"],
                },
            },
            "required": ["id", "status", "lines"],
        },
        {
            "id": "ABC-123456",
            "status": "paid",
            "lines": [{"sku": "pen", "qty": 2, "price": 1.5}, {"sku": "ink", "qty": 1, "price": 9}],
            "address": {"city": "Lyon", "zip": "69001"},
        },
    ),
    ("list", LIST_SCHEMA, {"title": "Fruit", "items": ["apple", "pear", "plum", "fig"]}),
]


def engine_tpot(model: Path, batch: int, new_tokens: int, repeats: int) -> dict[str, Any]:
    llm = LLM(str(model), max_model_len=512, kv_cache_bytes=256 << 20)
    names = ["fruits", "tools", "cities", "colours", "rivers", "birds", "games", "books"]
    prompts = [
        _chat(llm, f"List ten {names[i % len(names)]} as JSON with a title and items.")
        for i in range(batch)
    ]
    so = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(LIST_SCHEMA))
    guided_params = SamplingParams(max_tokens=new_tokens, temperature=0.0, structured=so)
    llm.generate(prompts, [guided_params] * batch)  # compiles, warms up
    t_guided, outs = _best(llm, prompts, [guided_params] * batch, repeats)
    lengths = [len(o.token_ids) for o in outs]
    plain = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    t_plain, _ = _best(llm, prompts, plain, repeats)
    steps = max(lengths)
    tpot_guided = t_guided / max(steps - 1, 1) * 1e3
    tpot_plain = t_plain / max(steps - 1, 1) * 1e3
    valid = sum(_parses(o.text) for o in outs if o.finish_reason == "stop")
    return {
        "batch": batch,
        "steps": steps,
        "tpot_plain_ms": round(tpot_plain, 2),
        "tpot_guided_ms": round(tpot_guided, 2),
        "ratio": round(tpot_guided / tpot_plain, 3),
        "finished_stop": sum(o.finish_reason == "stop" for o in outs),
        "valid_json": valid,
    }


def _chat(llm: LLM, question: str) -> list[int]:
    tokenizer = llm.engine.tokenizer
    assert tokenizer is not None
    text = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    return tokenizer.encode(text, add_special_tokens=False)


def _best(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams], repeats: int
) -> tuple[float, list[Any]]:
    """The best decode phase (``bench_inputs.decode_phase``) of ``repeats`` runs."""
    best = float("inf")
    outs: list[Any] = []
    for _ in range(repeats):
        seconds, outs = decode_phase(llm, prompts, params)
        best = min(best, seconds)
    return best, outs


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def grammar_engines(model: Path, repeats: int) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lgt
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    torch.set_num_threads(1)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(model / "tokenizer.json"))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    t = time.perf_counter()
    ll_tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    ll_table = time.perf_counter() - t
    t = time.perf_counter()
    xg_info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    xg_table = time.perf_counter() - t
    compiler = xgr.GrammarCompiler(xg_info, max_threads=1, cache_enabled=False)
    rows = []
    for name, schema, instance in SCHEMAS:
        ids = hf.encode(json.dumps(instance), add_special_tokens=False)
        text = json.dumps(schema)
        ll_compile, ll_masks, xg_compile, xg_masks = [], [], [], []
        for _ in range(repeats):
            t = time.perf_counter()
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text)
            matcher = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
            words = lgt.allocate_token_bitmask(1, vocab)
            lgt.fill_next_token_bitmask(matcher, words, 0)
            ll_compile.append(time.perf_counter() - t)
            ll_masks += _walk(
                functools.partial(lgt.fill_next_token_bitmask, matcher, words, 0),
                matcher.consume_token,
                ids,
            )
            t = time.perf_counter()
            compiled = compiler.compile_json_schema(text)
            xg_compile.append(time.perf_counter() - t)
            xmatcher = xgr.GrammarMatcher(compiled)
            xwords = xgr.allocate_token_bitmask(1, vocab)
            xg_masks += _walk(
                functools.partial(xmatcher.fill_next_token_bitmask, xwords),
                xmatcher.accept_token,
                ids,
            )
        rows.append(
            {
                "schema": name,
                "tokens": len(ids),
                "llguidance": _summary(ll_compile, ll_masks),
                "xgrammar": _summary(xg_compile, xg_masks),
            }
        )
    return {
        "table_build_ms": {"llguidance": round(ll_table * 1e3), "xgrammar": round(xg_table * 1e3)},
        "schemas": rows,
    }


def _walk(fill: Any, consume: Any, ids: list[int]) -> list[float]:
    times = []
    for token_id in ids:
        t = time.perf_counter()
        fill()
        times.append(time.perf_counter() - t)
        assert consume(token_id), token_id
    return times


def _summary(compile_s: list[float], masks_s: list[float]) -> dict[str, float]:
    return {
        "compile_ms": round(min(compile_s) * 1e3, 2),
        "mask_mean_us": round(statistics.mean(masks_s) * 1e6, 1),
        "mask_p50_us": round(statistics.median(masks_s) * 1e6, 1),
        "mask_max_us": round(max(masks_s) * 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.batch_sizes, args.new_tokens, args.repeats = "1,2", 16, 1
    model = args.model or (REPO / "models" / "bench-llama-tiny" if args.quick else CHAT_MODEL)
    if not (model / "config.json").is_file():
        if args.quick:
            from app.make_model import make_model

            make_model(model, arch="llama", size="tiny", seed=0)
        else:
            from app.fetch_model import fetch_model

            fetch_model("smollm2", model)
    tpot = [
        engine_tpot(model, int(b), args.new_tokens, args.repeats)
        for b in args.batch_sizes.split(",")
    ]
    print("\nTPOT with and without a JSON schema (greedy; the same steps in both runs)")
    print(f"{'batch':>5} {'steps':>5} {'plain ms':>9} {'guided ms':>10} {'ratio':>6} {'valid':>6}")
    for r in tpot:
        print(
            f"{r['batch']:>5} {r['steps']:>5} {r['tpot_plain_ms']:>9} {r['tpot_guided_ms']:>10}"
            f" {r['ratio']:>6} {r['valid_json']:>3}/{r['finished_stop']:<2}"
        )
    engines = grammar_engines(model, args.repeats)
    print(f"\ntoken table build (ms): {engines['table_build_ms']}")
    head = f"{'schema':>8} {'engine':>11} {'compile ms':>11} {'mask mean us':>13}"
    print(f"{head} {'p50':>7} {'max':>8}")
    for row in engines["schemas"]:
        for name in ("llguidance", "xgrammar"):
            s = row[name]
            print(
                f"{row['schema']:>8} {name:>11} {s['compile_ms']:>11} {s['mask_mean_us']:>13}"
                f" {s['mask_p50_us']:>7} {s['mask_max_us']:>8}"
            )
        ratio = row["xgrammar"]["mask_mean_us"] / max(row["llguidance"]["mask_mean_us"], 1e-9)
        print(f"{'':>8} xgrammar / llguidance mask mean: {ratio:.2f}x")
    print(json.dumps({"bench": "structured", "model": str(model), "tpot": tpot, **engines}))


if __name__ == "__main__":
    main()
