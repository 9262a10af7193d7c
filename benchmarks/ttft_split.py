"""The TTFT split of ``benchmarks/kv_transfer.py`` (part 2): prefill compute alone, then a local
cluster serving sequential fresh prompts; see that file's docstring."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench_inputs import REPO, ensure_model, make_prompts  # sibling module

from app.client import GenerateResult, generate, router_channel
from app.local_cluster import ClusterConfig, LocalCluster
from engine import SamplingParams
from native_engine import LLM
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

BLOCK_SIZE = 16
TRANSFER_GOAL = 0.10  # transfer_s / ttft_s, at most


def measure_compute(model_dir: Path, prompts: list[list[int]], max_model_len: int) -> list[float]:
    """Seconds per prefill (``max_tokens=1``) of each prompt after the first (the warm-up), in
    an in-process engine that is freed again before the cluster starts."""
    per_seq = -(-max_model_len // BLOCK_SIZE)
    llm = LLM(str(model_dir), block_size=BLOCK_SIZE, num_blocks=2 * per_seq)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times: list[float] = []
    for prompt in prompts:
        start = time.perf_counter()
        llm.generate([prompt], params)
        times.append(time.perf_counter() - start)
    del llm
    gc.collect()
    return times[1:]


async def cluster_requests(
    address: str, prompts: list[list[int]], max_tokens: int
) -> list[GenerateResult]:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    results: list[GenerateResult] = []
    async with router_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for prompt in prompts:  # sequential: nothing queues behind another request
            request = router_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)
            result = await generate(stub, request, timeout_s=600.0)
            if result.completion_tokens != max_tokens:
                raise RuntimeError(f"got {result.completion_tokens} tokens, not {max_tokens}")
            results.append(result)
    return results


def measure_ttft(
    args: argparse.Namespace, backend: str = "grpc", previous: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``backend``: the cluster's KV transfer; ``previous``: a split of the same prompts whose
    prefill compute is reused (it does not depend on the backend)."""
    model_dir = ensure_model(args)
    cfg: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    vocab, max_pos = int(cfg["vocab_size"]), int(cfg["max_position_embeddings"])
    prompt_len, note = args.prompt_len, ""
    if prompt_len + args.max_tokens > max_pos:
        prompt_len = max_pos - args.max_tokens
        note = (
            f"prompt cut from {args.prompt_len} to {prompt_len} tokens: "
            f"max_position_embeddings {max_pos} - max_tokens {args.max_tokens}"
        )
        print(note, flush=True)
    n = 1 + args.ttft_repeats  # one warm-up each
    if previous is not None:
        compute = previous["compute_runs_s"]
    else:
        print(f"prefill compute, in-process engine ({prompt_len} tokens) ...", flush=True)
        prompts = [make_prompts(100 + i, 1, prompt_len, vocab)[0] for i in range(n)]
        compute = measure_compute(model_dir, prompts, max_pos)
    print(f"TTFT, local cluster (router + 1 prefill + 1 decode, {backend}) ...", flush=True)
    workers = ("--kv-backend", backend)
    config = ClusterConfig(
        model=str(model_dir), log_level="WARNING", prefill_args=workers, decode_args=workers
    )
    with LocalCluster(config) as cluster:
        prompts = [make_prompts(200 + i, 1, prompt_len, vocab)[0] for i in range(n)]
        results = asyncio.run(cluster_requests(cluster.address, prompts, args.max_tokens))
    results = results[1:]
    ttft = [r.ttft_s for r in results]
    prefill = [r.prefill_s for r in results]
    transfer = [r.transfer_s for r in results]
    med = statistics.median
    return {
        "backend": backend,
        "model": str(model_dir.relative_to(REPO) if model_dir.is_relative_to(REPO) else model_dir),
        "max_position_embeddings": max_pos,
        "requested_prompt_tokens": args.prompt_len,
        "prompt_tokens": prompt_len,
        "note": note,
        "max_tokens": args.max_tokens,
        "repeats": args.ttft_repeats,
        "kv_bytes": -(-prompt_len // BLOCK_SIZE) * kv_block_bytes(cfg),
        "cached_tokens": [r.cached_tokens for r in results],
        "ttft_runs_s": ttft,
        "compute_runs_s": compute,
        "prefill_runs_s": prefill,
        "transfer_runs_s": transfer,
        "tpot_runs_s": [r.mean_tpot_s for r in results],
        "ttft_s": med(ttft),
        "compute_s": med(compute),
        "prefill_s": med(prefill),
        "overhead_s": med(prefill) - med(compute),
        "transfer_s": med(transfer),
        "tpot_s": med(r.mean_tpot_s for r in results),
        "transfer_over_ttft": med(transfer) / med(ttft),
        "goal_transfer_over_ttft": TRANSFER_GOAL,
    }


def kv_block_bytes(cfg: dict[str, Any]) -> int:
    """float32 KV bytes per block of the checkpoint (what the cluster's transfer moves)."""
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // cfg["num_attention_heads"])
    kv_heads = int(cfg["num_key_value_heads"])
    return 2 * int(cfg["num_hidden_layers"]) * BLOCK_SIZE * kv_heads * head_dim * 4


# ---------------------------------------------------------------- report
