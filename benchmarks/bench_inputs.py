"""What the benchmarks share: a cached random-init checkpoint, random prompts, fixed leases, the
decode phase's time (and a greedy run timed whole and by its decode phase), a local cluster's
prompt tokens computed."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from app.client import router_channel
from app.local_cluster import LocalCluster
from app.make_model import make_model
from engine import SamplingParams
from engine.outputs import RequestOutput
from kvtransfer.base import BlockLeases
from native_engine import LLM
from pdserve.v1 import common_pb2, prefill_pb2_grpc

REPO = Path(__file__).resolve().parents[1]


def ensure_model(args: argparse.Namespace) -> Path:
    """``args.model``, or ``models/bench-llama-<args.size>`` (built once when missing)."""
    model_dir: Path = args.model or REPO / "models" / f"bench-llama-{args.size}"
    if not (model_dir / "config.json").is_file():
        print(f"building {args.size} llama checkpoint in {model_dir} ...", flush=True)
        make_model(model_dir, arch="llama", size=args.size, seed=0)
    return model_dir


def make_prompts(seed: int, batch: int, length: int, vocab: int) -> list[list[int]]:
    """Random ids past the special tokens (0..2); a distinct seed per run defeats prefix caching."""
    gen = torch.Generator().manual_seed(seed)
    ids: list[list[int]] = torch.randint(3, vocab, (batch, length), generator=gen).tolist()
    return ids


class FixedLeases(BlockLeases):
    """A benchmark sender's leases: every request id leases the same blocks, forever; a
    checkin frees nothing."""

    def __init__(self, block_ids: list[int]) -> None:
        self.block_ids = block_ids

    async def checkout(self, request_id: str, lease_token: str) -> list[int]:
        return list(self.block_ids)

    async def checkin(self, request_id: str) -> None:
        return None


def decode_phase(
    llm: LLM, prompts: Sequence[list[int]], params: Sequence[SamplingParams]
) -> tuple[float, list[RequestOutput]]:
    """Runs ``prompts`` to the end; the seconds from the step that gave every prompt its first
    token to the last token (the decode phase, no prefill in it: measured in one run, where a
    difference of two runs, t(max_tokens=N) - t(max_tokens=1), went negative on a loaded
    machine), and the outputs."""
    outputs = llm.generate(list(prompts), list(params))
    first = [o.first_token_s for o in outputs if o.first_token_s is not None]
    last = [o.last_token_s for o in outputs if o.last_token_s is not None]
    return (max(last) - max(first) if first else 0.0), outputs


@dataclass(frozen=True)
class Timing:
    """One timed run: its seconds, and those of its decode phase (``decode_phase``: every
    prompt's first token to the last token, N - 1 steps)."""

    seconds: float
    decode_seconds: float


def greedy_run(
    llm: LLM, prompts: Sequence[list[int]], max_tokens: int
) -> tuple[Timing, list[RequestOutput]]:
    """``prompts`` decoded greedily, EOS ignored, to ``max_tokens`` each: the run's timing, and
    the outputs."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    decode_seconds, outputs = decode_phase(llm, prompts, [params] * len(prompts))
    return Timing(time.perf_counter() - start, decode_seconds), outputs


async def prefill_tokens_computed(cluster: LocalCluster) -> int:
    """Prompt tokens a local cluster's prefill workers computed (their own counters, exact)."""
    total = 0
    for component in cluster.prefill:
        async with router_channel(component.address) as channel:
            stats = await prefill_pb2_grpc.PrefillWorkerStub(channel).GetStats(
                common_pb2.GetStatsRequest()
            )
        total += stats.num_prompt_tokens_computed
    return total
