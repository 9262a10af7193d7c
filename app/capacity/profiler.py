"""``pdserve profile``: one worker's costs on this hardware, measured with the real engine
(native or vLLM, driven through the serving contract as a worker drives it), in minutes.
Prefill steps by prompt tokens (no cached prefix, and half the prompt cached), decode steps by
batch size and context, and KV pulls by size with the configured backend (sender and receiver
in this process, over loopback): each fitted (``profile.py``) with its residuals.

The router's per-request overhead is not measured here (it needs a running router): it is
``router_overhead_s`` in the profile, 0 by default, and the planner accuracy benchmark reads it
from real runs. Every timing is a median of ``repeats`` after one discarded warm-up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import platform
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from app.capacity.profile import (
    DECODE_FEATURES,
    PREFILL_FEATURES,
    TRANSFER_FEATURES,
    Profile,
    fit_linear,
)
from app.components import engine_builder
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.outputs import RequestUpdate
from engine.sampling_params import SamplingParams
from engine.serving_engine import EngineHooks, ServingEngine
from kvtransfer import KVHandle, ReceiverOptions, SenderOptions
from kvtransfer.base import BlockLeases, TransferStats
from kvtransfer.sharded import engine_receiver, engine_sender


@dataclass(frozen=True)
class ProfilePlan:
    prompt_tokens: tuple[int, ...] = (16, 64, 256, 512, 1024, 2048)
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    contexts: tuple[int, ...] = (64, 512)
    transfer_blocks: tuple[int, ...] = (4, 16, 64)
    repeats: int = 3


QUICK = ProfilePlan((16, 64, 128), (1, 2, 4), (32, 96), (2, 8), 2)


class _Ids:
    """Fresh prompt ids (no prefix hit is accidental) and request ids for every measurement."""

    def __init__(self) -> None:
        self.next = 16

    def take(self, n: int) -> list[int]:
        ids = [16 + (self.next + i) % 900 for i in range(n)]
        self.next += n + 7
        return ids

    def request_id(self) -> str:
        self.next += 1
        return f"profile-{self.next}"


async def _generate(
    engine: ServingEngine, rid: str, prompt: list[int], params: SamplingParams
) -> None:
    async for _ in engine.generate(rid, prompt, params):
        pass


async def _prefill_samples(
    engine: ServingEngine, config: EngineConfig, plan: ProfilePlan, ids: _Ids
) -> tuple[list[tuple[float, float]], list[float]]:
    rows, times = [], []
    limit = min(config.scheduler.max_num_batched_tokens, engine.max_model_len - 1)
    one = SamplingParams(max_tokens=1, ignore_eos=True)

    async def timed(total: int, cached: int) -> float:
        prompt = ids.take(total)
        if cached:  # the prefix goes into the cache first, untimed
            await _generate(engine, ids.request_id(), prompt[:cached], one)
        start = time.perf_counter()
        await _generate(engine, ids.request_id(), prompt, one)
        return time.perf_counter() - start

    for total in (t for t in plan.prompt_tokens if t <= limit):
        for cached in (0, total // 2 // engine.block_size * engine.block_size):
            samples = [await timed(total, cached) for _ in range(plan.repeats + 1)][1:]
            new = total - cached
            rows.append((float(new), new * total / 1e3))
            times.append(statistics.median(samples))
    return rows, times


class _Batch:
    """Requests decoding together, and how far the slowest one is."""

    def __init__(self, size: int) -> None:
        self.counts = [0] * size
        self._moved = asyncio.Condition()

    async def consume(self, i: int, stream: AsyncIterator[RequestUpdate]) -> None:
        async for update in stream:
            async with self._moved:
                self.counts[i] += len(update.new_token_ids)
                self._moved.notify_all()

    async def all_reach(self, tokens: int) -> None:
        async with self._moved:
            await self._moved.wait_for(lambda: min(self.counts) >= tokens)


async def _decode_samples(
    engine: ServingEngine, config: EngineConfig, plan: ProfilePlan, ids: _Ids
) -> tuple[list[tuple[float, float]], list[float]]:
    """Seconds per decode step, by batch size and context: the time every request of the
    batch took to gain ``steps`` more tokens, over the engine's own count of steps meanwhile."""
    rows, times = [], []
    steps = 4
    for context in (c for c in plan.contexts if c + steps + 2 < engine.max_model_len):
        for batch in (b for b in plan.batch_sizes if b <= config.scheduler.max_num_seqs):
            windows = plan.repeats + 1  # the first, a warm-up, is discarded
            params = SamplingParams(max_tokens=steps * (windows + 1) + 1, ignore_eos=True)
            running = _Batch(batch)
            tasks = [
                asyncio.create_task(
                    running.consume(i, engine.generate(ids.request_id(), ids.take(context), params))
                )
                for i in range(batch)
            ]
            samples = []
            try:
                await running.all_reach(1)  # every prompt prefilled
                for window in range(1, windows + 1):
                    steps_before, start = engine.stats.num_steps, time.perf_counter()
                    await running.all_reach(1 + window * steps)
                    done = max(engine.stats.num_steps - steps_before, 1)
                    samples.append((time.perf_counter() - start) / done)
            finally:
                for task in tasks:  # leaving a stream aborts its request
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            rows.append((float(batch), batch * (context + steps) / 1e3))
            times.append(statistics.median(samples[1:]))
    return rows, times


class _Leased(BlockLeases):
    def __init__(self) -> None:
        self.block_ids: list[int] = []

    async def checkout(self, request_id: str, lease_token: str) -> list[int]:
        return list(self.block_ids)

    async def checkin(self, request_id: str) -> None:
        return None


async def _transfer_samples(
    engine: ServingEngine, backend: str, plan: ProfilePlan, ids: _Ids
) -> tuple[list[tuple[float]], list[float]]:
    """A pinned prefill pulled, through the backend over loopback, into blocks admitted on the
    same engine: what a decode worker's admission spends on the KV."""
    leases = _Leased()
    sender = engine_sender(engine, backend, leases, SenderOptions("127.0.0.1", 0))
    await sender.start()
    receiver = engine_receiver(engine, backend, ReceiverOptions(timeout_s=60.0))
    if receiver is None:
        await sender.stop()
        raise ValueError("this engine takes no remote KV: no transfer to measure")
    rows, times = [], []
    first_only = SamplingParams(max_tokens=2, ignore_eos=True)
    try:
        for num_blocks in (n for n in plan.transfer_blocks if n <= engine.num_blocks // 2):
            source = ids.request_id()
            prompt = ids.take(min(num_blocks * engine.block_size, engine.max_model_len - 2))
            async for _ in engine.generate(source, prompt, first_only, prefill_only=True):
                pass
            pinned = engine.export_prefilled(source)
            leases.block_ids = pinned.block_ids
            handle = KVHandle(
                backend, sender.address, source, len(pinned.block_ids), engine.kv_layout, 60.0
            )
            samples = []

            async def pull(block_ids: list[int], handle: KVHandle = handle) -> TransferStats:
                return await receiver.pull(handle, block_ids)

            for _ in range(plan.repeats + 1):
                request = dataclasses.replace(pinned, request_id=ids.request_id(), block_ids=[])
                pulled = await engine.admit_prefilled(request, pull)
                await engine.abort(request.request_id)
                samples.append(pulled.duration_s)
            await engine.free_pinned(source)
            rows.append((float(len(pinned.block_ids) * engine.kv_layout.block_bytes),))
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
    return asyncio.run(_measure(config, backend, plan))


async def _measure(config: EngineConfig, backend: str, plan: ProfilePlan) -> Profile:
    engine = await engine_builder(config)(config, EngineHooks())
    engine.start()
    try:
        ids = _Ids()
        prefill_rows, prefill_times = await _prefill_samples(engine, config, plan, ids)
        decode_rows, decode_times = await _decode_samples(engine, config, plan, ids)
        transfer_rows, transfer_times = await _transfer_samples(engine, backend, plan, ids)
    finally:
        await engine.close()
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
            "engine": config.backend.value,
            "device": config.device or ("cuda" if torch.cuda.is_available() else "cpu"),
        },
    )


def engine_config(
    model: str,
    dtype: str,
    device: str | None,
    num_blocks: int | None,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> EngineConfig:
    return EngineConfig(
        model=model,
        dtype=dtype,
        device=device,
        cache=CacheConfig(num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens),
    )
