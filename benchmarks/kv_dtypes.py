"""Part (b) of ``kv_tiers.py``: the KV cache dtype (float32, bfloat16, int8, fp8_e4m3), same run.

For each, on one model: bytes per token (scales included) and the ratio to the same model's
bfloat16 cache; the time to pull a ``--transfer-tokens``-token prompt's blocks over the gRPC
backend (a real prefill fills the sender's cache; loopback, in process; median of
``--transfer-repeats`` after three warm-ups); the most sequences of ``--transfer-tokens`` + 64
tokens a fixed ``--cache-mib`` cache holds (the engine's own sizing); and, for the quantized
caches, teacher-forced greedy agreement with the full-precision cache over
``--agreement-tokens`` positions of each chat answer (the share of positions where the
quantized argmax is the full-precision greedy token), each answer's first divergence and the
largest logit error.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from bench_inputs import FixedLeases  # sibling module

from app.bench.workload import OPEN_ENDED_QUESTIONS
from engine import SamplingParams
from engine.kv_layout import KVCacheDtype
from kvtransfer.base import KVHandle
from kvtransfer.grpc_stream import GrpcKVReceiver, GrpcKVSender
from native_engine import LLM
from native_engine.diagnostics import teacher_forced_agreement
from native_engine.kv_cache import KVCache

OUTPUT_ALLOWANCE = 64  # tokens each sequence of the capacity count may generate
# Untimed pulls first: the first few of a process run at up to twice the steady time (fresh
# pages, the allocator settling on chunk-sized buffers), which a serving worker never sees.
WARMUPS = 3


async def _time_pulls(cache: KVCache, block_ids: list[int], repeats: int) -> tuple[float, bool]:
    sender = GrpcKVSender(cache, FixedLeases(block_ids))
    await sender.start()
    destination = KVCache(cache.layout, len(block_ids), cache.tensor.device)
    receiver = GrpcKVReceiver(destination, timeout_s=120)
    targets = list(range(len(block_ids)))
    times = []
    try:
        for i in range(WARMUPS + repeats):
            handle = KVHandle("grpc", sender.address, f"r{i}", len(block_ids), cache.layout, 60.0)
            start = time.perf_counter()
            await receiver.pull(handle, targets)
            if i >= WARMUPS:
                times.append(time.perf_counter() - start)
    finally:
        await receiver.close()
        await sender.stop()
    same = bool(torch.equal(destination.tensor, cache.tensor[:, :, block_ids]))
    return statistics.median(times), same


def _prefill(llm: LLM, prompt: list[int]) -> str:
    """Prefills ``prompt`` as a prefill worker does; its blocks stay pinned until freed."""
    engine = llm.engine
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=1), prefill_only=True)
    while request_id not in engine.pinned:
        engine.step()
    return request_id


def _chat_prompts(llm: LLM) -> list[list[int]]:
    tokenizer = llm.engine.tokenizer
    assert tokenizer is not None
    return [
        tokenizer.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n")
        for q in OPEN_ENDED_QUESTIONS
    ]


def measure_dtypes(model: Path, args: Any) -> dict[str, Any]:
    rng = random.Random(0)
    results: dict[str, Any] = {}
    reference = LLM(str(model))
    vocab = reference.engine.model_config.vocab_size
    prompts = (
        _chat_prompts(reference)
        if args.chat
        else [[rng.randrange(3, vocab) for _ in range(24)] for _ in OPEN_ENDED_QUESTIONS]
    )
    greedy = SamplingParams(max_tokens=args.agreement_tokens, temperature=0.0, ignore_eos=True)
    references = [out.token_ids for out in reference.generate(prompts, greedy)]
    transfer_prompt = [rng.randrange(3, vocab) for _ in range(args.transfer_tokens)]
    # (name, model dtype, cache dtype): the bfloat16 cache is the baseline the goal names;
    # the quantized caches' bytes do not depend on the model dtype (one-byte codes, f32 scales).
    settings = [
        ("float32", "float32", KVCacheDtype.AUTO),
        ("bfloat16", "bfloat16", KVCacheDtype.AUTO),
    ]
    settings += [(kind.value, "float32", kind) for kind in KVCacheDtype if kind.quantized]
    for name, dtype, kind in settings:
        llm = LLM(
            str(model),
            dtype=dtype,
            kv_cache_dtype=kind.value,
            kv_cache_bytes=args.cache_mib << 20,
            max_num_seqs=4096,  # the memory budget, not the seat cap, sizes the cache
            max_model_len=args.transfer_tokens + OUTPUT_ALLOWANCE,
        )
        layout = llm.engine.kv_layout
        per_seq_blocks = -(-(args.transfer_tokens + OUTPUT_ALLOWANCE) // layout.block_size)
        request_id = _prefill(llm, transfer_prompt)
        block_ids = llm.engine.export_prefilled(request_id).block_ids
        transfer_s, same = asyncio.run(
            _time_pulls(llm.engine.kv_cache, block_ids, args.transfer_repeats)
        )
        llm.engine.free_pinned(request_id)
        row: dict[str, Any] = {
            "bytes_per_token": layout.block_bytes // layout.block_size,
            "transfer_ms": round(1000 * transfer_s, 2),
            "transfer_bytes": len(block_ids) * layout.block_bytes,
            "transfer_lossless": same,
            "num_blocks": llm.engine.num_blocks,
            "max_concurrent_seqs": llm.engine.num_blocks // per_seq_blocks,
        }
        if "bfloat16" in results:
            base = results["bfloat16"]
            row["vs_bf16_bytes"] = round(row["bytes_per_token"] / base["bytes_per_token"], 3)
            row["vs_bf16_transfer"] = round(row["transfer_ms"] / base["transfer_ms"], 3)
        if kind.quantized:
            rows = [
                teacher_forced_agreement(reference.engine, llm.engine, p, ref)
                for p, ref in zip(prompts, references, strict=True)
            ]
            matching = sum(a.num_matching for a in rows)
            row["agreement"] = round(matching / sum(a.num_positions for a in rows), 4)
            row["min_prompt_agreement"] = round(min(a.rate for a in rows), 4)
            row["first_divergence"] = [a.first_divergence for a in rows]
            row["max_logit_error"] = round(max(a.max_logit_error for a in rows), 4)
        results[name] = row
    return results
