"""The Ray rows of benchmarks/kv_transfer.py: the Ray object store backend moving the same
blocks between two actors, beside raw ``ray.put`` + ``ray.get`` of the same bytes.

Two async actors on a local Ray started here. The sender actor holds a ``KVCache`` filled like
part 1's and serves it through ``RayKVSender`` (leases that never expire; each timed pull uses a
new request id, so every pull stages afresh: gather, digest, ``ray.put``). The receiver actor
times ``RayKVReceiver.pull`` into its own cache: from the request to the last layer written,
digests checked. Raw: the sender actor ``ray.put``s a preallocated buffer of the same size and
returns the reference; the receiver ``ray.get``s it (zero-copy). A second raw variant also
copies the bytes into a preallocated destination, as any transfer into a KV cache must.
Interleaved runs, medians; the first pull's bytes are checked against the sender's cache.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Any

import numpy as np
import ray
import torch

from kvtransfer.base import BlockLeases, KVHandle
from kvtransfer.ray_object_store import RayKVReceiver, RayKVSender
from native_engine.kv_cache import KVCache

RAY_GOAL = 0.8  # Ray backend throughput / raw put+get throughput, at least


class _SenderActor:
    async def start(self, num_blocks: int) -> str:
        from bench_inputs import FixedLeases
        from kv_transfer import filled_cache, sender_block_ids

        leases: BlockLeases = FixedLeases(sender_block_ids(num_blocks))
        self.sender = RayKVSender(filled_cache(num_blocks), leases)
        await self.sender.start()
        self.raw = np.full(self.sender.cache.tensor.nbytes, 0xA5, dtype=np.uint8)
        self.raw_ref: Any = None
        return self.sender.address

    async def lease_ended(self, request_id: str) -> None:
        self.sender.lease_ended(request_id)

    async def raw_put(self) -> list[Any]:
        self.raw_ref = ray.put(self.raw)
        return [self.raw_ref]  # in a list: Ray passes the reference

    async def raw_drop(self) -> None:
        self.raw_ref = None

    async def stop(self) -> None:
        await self.sender.stop()


class _ReceiverActor:
    def __init__(self, num_blocks: int) -> None:
        from kv_transfer import LAYOUT

        self.cache = KVCache(LAYOUT, num_blocks, torch.device("cpu"))
        self.receiver = RayKVReceiver(self.cache)
        self.destination = np.empty(self.cache.tensor.nbytes, dtype=np.uint8)

    async def pull(self, address: str, request_id: str) -> float:
        from kv_transfer import LAYOUT

        num_blocks = self.cache.num_blocks
        handle = KVHandle("ray", address, request_id, num_blocks, LAYOUT, 30.0)
        self.cache.tensor.zero_()  # outside the timing; a stale cache cannot pass the check
        start = time.perf_counter()
        stats = await self.receiver.pull(handle, list(range(num_blocks)))
        elapsed = time.perf_counter() - start
        if stats.num_bytes != self.cache.tensor.nbytes:
            raise RuntimeError(f"pulled {stats.num_bytes} bytes of {self.cache.tensor.nbytes}")
        return elapsed

    def verify(self) -> bool:
        from kv_transfer import filled_cache, sender_block_ids

        num_blocks = self.cache.num_blocks
        sent = filled_cache(num_blocks).tensor[:, :, sender_block_ids(num_blocks)]
        return bool(torch.equal(self.cache.tensor, sent))

    async def raw(self, sender: Any, copy: bool) -> float:
        start = time.perf_counter()
        [ref] = await sender.raw_put.remote()
        data = await ref
        if copy:
            np.copyto(self.destination, data)
        elapsed = time.perf_counter() - start
        if data[-1] != 0xA5:
            raise RuntimeError("raw Ray transfer delivered wrong bytes")
        del data, ref
        await sender.raw_drop.remote()
        return elapsed


def measure_ray(args: argparse.Namespace, num_blocks: int) -> dict[str, Any]:
    """Starts a local Ray (``num_cpus`` is logical), runs both actors, shuts Ray down."""
    import kv_transfer

    ray.init(
        num_cpus=4,
        include_dashboard=False,
        logging_level=logging.WARNING,
        # The actors import the benchmark's sibling modules.
        runtime_env={"env_vars": {"PYTHONPATH": str(kv_transfer.REPO / "benchmarks")}},
    )
    try:
        sender: Any = ray.remote(num_cpus=0)(_SenderActor).remote()
        receiver: Any = ray.remote(num_cpus=0)(_ReceiverActor).remote(num_blocks)
        address = ray.get(sender.start.remote(num_blocks))
        ray_s: list[float] = []
        raw_s: list[float] = []
        raw_copy_s: list[float] = []

        def pull(i: int) -> float:
            elapsed = float(ray.get(receiver.pull.remote(address, f"bench-{i}")))
            ray.get(sender.lease_ended.remote(f"bench-{i}"))  # frees the staged object
            return elapsed

        pull(-1)  # warm-up: mailbox lookup, first allocations
        verified = bool(ray.get(receiver.verify.remote()))
        ray.get(receiver.raw.remote(sender, True))
        for i in range(args.repeats):  # interleaved: load drift hits all alike
            ray_s.append(pull(i))
            raw_s.append(ray.get(receiver.raw.remote(sender, False)))
            raw_copy_s.append(ray.get(receiver.raw.remote(sender, True)))
        verified = verified and bool(ray.get(receiver.verify.remote()))
        ray.get(sender.stop.remote())
    finally:
        ray.shutdown()
    num_bytes = num_blocks * kv_transfer.LAYOUT.block_bytes
    ray_med = statistics.median(ray_s)
    raw_med, raw_copy_med = statistics.median(raw_s), statistics.median(raw_copy_s)
    return {
        "verified": verified,
        "ray_s": ray_s,
        "raw_ray_s": raw_s,
        "raw_ray_copy_s": raw_copy_s,
        "ray_gb_s": num_bytes / ray_med / 1e9,
        "raw_ray_gb_s": num_bytes / raw_med / 1e9,
        "raw_ray_copy_gb_s": num_bytes / raw_copy_med / 1e9,
        "ray_over_raw": raw_med / ray_med,
        "ray_over_raw_copy": raw_copy_med / ray_med,
        "goal_ray_over_raw": RAY_GOAL,
    }
