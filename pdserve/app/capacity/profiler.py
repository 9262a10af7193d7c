"""``pdserve profile``: one worker's costs on this hardware, measured with the real engine, in
minutes. Prefill steps by prompt tokens (no cached prefix, and half the prompt cached), decode
steps by batch size and context, and KV pulls by size with the configured backend (sender and
receiver in this process, over loopback): each fitted (``profile.py``) with its residuals.

The router's per-request overhead is not measured here (it needs a running router): it is
``router_overhead_s`` in the profile, 0 by default, and the planner accuracy benchmark reads it
from real runs. Every timing is a median of ``repeats`` after one discarded warm-up.
"""

from __future__ import annotations

import asyncio
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.kv_cache import KVCache
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from kvtransfer import KVHandle, make_receiver, make_sender
from kvtransfer.base import BlockLeases
from pdserve.app.capacity.profile import (
    DECODE_FEATURES,
    PREFILL_FEATURES,
    TRANSFER_FEATURES,
    Profile,
    fit_linear,
)


@dataclass(frozen=True)
class ProfilePlan:
    prompt_tokens: tuple[int, ...] = (16, 64, 256, 512, 1024, 2048)
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    contexts: tuple[int, ...] = (64, 512)
    transfer_blocks: tuple[int, ...] = (4, 16, 64)
    repeats: int = 3


QUICK = ProfilePlan((16, 64, 128), (1, 2, 4), (32, 96), (2, 8), 2)


def _median_s(action: Callable[[], None], repeats: int) -> float:
    action()  # warm-up: allocator, kernels, caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class _Ids:
    """Fresh prompt ids for every measurement, so no prefix hit is accidental."""

    def __init__(self) -> None:
        self.next = 16

    def take(self, n: int) -> list[int]:
        ids = [16 + (self.next + i) % 900 for i in range(n)]
        self.next += n + 7
        return ids


def _drain(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def _prefill_samples(
    engine: LLMEngine, plan: ProfilePlan, ids: _Ids
) -> tuple[list[tuple[float, float]], list[float]]:
    rows, times = [], []
    limit = min(engine.config.scheduler.max_num_batched_tokens, engine.max_model_len - 1)
    one = SamplingParams(max_tokens=1, ignore_eos=True)

    def timed(total: int, cached: int) -> float:
        prompt = ids.take(total)
        if cached:  # the prefix goes into the cache first, untimed
            engine.add_request(prompt[:cached], one)
            _drain(engine)
        engine.add_request(prompt, one)
        start = time.perf_counter()
        _drain(engine)
        return time.perf_counter() - start

    for total in (t for t in plan.prompt_tokens if t <= limit):
        for cached in (0, total // 2 // engine.block_size * engine.block_size):
            samples = [timed(total, cached) for _ in range(plan.repeats + 1)][1:]  # warm-up out
            new = total - cached
            rows.append((float(new), new * total / 1e3))
            times.append(statistics.median(samples))
    return rows, times


def _decode_samples(
    engine: LLMEngine, plan: ProfilePlan, ids: _Ids
) -> tuple[list[tuple[float, float]], list[float]]:
    rows, times = [], []
    steps = 4
    for context in (c for c in plan.contexts if c + steps + 2 < engine.max_model_len):
        for batch in plan.batch_sizes:
            if batch > engine.config.scheduler.max_num_seqs:
                continue
            params = SamplingParams(max_tokens=steps * (plan.repeats + 2), ignore_eos=True)
            request_ids = [engine.add_request(ids.take(context), params) for _ in range(batch)]
            while engine.scheduler.waiting or any(  # every prompt prefilled
                s.num_output_tokens == 0 for s in engine.scheduler.running
            ):
                engine.step()

            def decode_steps() -> None:
                for _ in range(steps):
                    engine.step()

            per_step = _median_s(decode_steps, plan.repeats) / steps
            for request_id in request_ids:
                engine.abort(request_id)
            rows.append((float(batch), batch * (context + steps) / 1e3))
            times.append(per_step)
    return rows, times


class _Leased(BlockLeases):
    def __init__(self) -> None:
        self.block_ids: list[int] = []

    def checkout(self, request_id: str, lease_token: str) -> list[int]:
        return list(self.block_ids)

    async def checkin(self, request_id: str) -> None:
        return None


async def _transfer_samples(
    engine: LLMEngine, backend: str, plan: ProfilePlan
) -> tuple[list[tuple[float]], list[float]]:
    leases = _Leased()
    sender = make_sender(backend, engine.kv_cache, leases, "127.0.0.1", 0)
    await sender.start()
    cache = KVCache(engine.kv_layout, engine.num_blocks, engine.kv_cache.tensor.device)
    receiver = make_receiver(backend, cache, timeout_s=60.0)
    rows, times = [], []
    try:
        for num_blocks in (n for n in plan.transfer_blocks if n <= engine.num_blocks):
            leases.block_ids = list(range(num_blocks))
            samples = []
            for i in range(plan.repeats + 1):
                handle = KVHandle(backend, sender.address, f"p{num_blocks}-{i}", num_blocks,
                                  engine.kv_layout, 60.0)  # fmt: skip
                start = time.perf_counter()
                await receiver.pull(handle, list(range(num_blocks)))
                samples.append(time.perf_counter() - start)
            rows.append((float(num_blocks * engine.kv_layout.block_bytes),))
            times.append(statistics.median(samples[1:]))
    finally:
        await receiver.close()
        await sender.stop()
    return rows, times


def hardware() -> dict[str, object]:
    info: dict[str, object] = {
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def measure(config: EngineConfig, backend: str, plan: ProfilePlan) -> Profile:
    """Builds one engine from ``config`` and measures it (blocking: minutes)."""
    if backend == "ray":
        raise ValueError("pdserve profile measures grpc, nixl or local transfers, not ray")
    engine = LLMEngine(config)
    ids = _Ids()
    prefill_rows, prefill_times = _prefill_samples(engine, plan, ids)
    decode_rows, decode_times = _decode_samples(engine, plan, ids)
    transfer_rows, transfer_times = asyncio.run(_transfer_samples(engine, backend, plan))
    layout = engine.kv_layout
    return Profile(
        prefill=fit_linear(PREFILL_FEATURES, prefill_rows, prefill_times),
        decode=fit_linear(DECODE_FEATURES, decode_rows, decode_times),
        transfer=fit_linear(TRANSFER_FEATURES, transfer_rows, transfer_times),
        kv_bytes_per_token=layout.block_bytes // layout.block_size,
        block_size=engine.block_size,
        num_blocks=engine.num_blocks,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        model_fingerprint=engine.fingerprint,
        dtype=config.dtype,
        hardware={
            **hardware(),
            "kv_backend": backend,
            "device": str(engine.kv_cache.tensor.device),
        },
    )


def engine_config(
    model: str, dtype: str, device: str | None, num_blocks: int | None,
    max_num_seqs: int, max_num_batched_tokens: int,
) -> EngineConfig:  # fmt: skip
    return EngineConfig(
        model=model,
        dtype=dtype,
        device=device,
        cache=CacheConfig(num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens),
    )
