"""The cluster prefix-cache index: for each worker, the block hashes its prefix cache holds.

Who calls what:
- A worker calls ``apply`` with the KV events it drained from its engine (batched; each batch
  names its tier: the device cache or the host tier), and ``replace`` with a full snapshot of a
  tier when it (re)connects, so the index heals after a restart.
- The router calls ``prefix_hits`` with a prompt's chained block hashes (the engine's own
  hasher, ``engine.block_hash``) and the live candidate workers: in one lookup, the leading
  blocks in the device tier and in both tiers together (a block in either can be reused: the
  host tier's after a copy). ``longest_prefixes`` asks about any one set of tiers.
- Whoever sees a worker leave (deregistration, heartbeat expiry) calls ``remove_worker``.
The index holds no blocks and frees nothing: a stale entry costs a routing miss, never
correctness, and the worker's own prefix cache decides what is really reused.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from engine.block_hash import BlockHash
from engine.kv_events import CacheTier, KVEvents

DEVICE_ONLY = (CacheTier.DEVICE,)
ANY_TIER = (CacheTier.DEVICE, CacheTier.HOST)


@dataclass(frozen=True)
class PrefixHits:
    """One worker's leading blocks of a prompt: on its device, and counting its host tier."""

    num_device_blocks: int
    num_any_tier_blocks: int  # >= num_device_blocks


class PrefixIndex(ABC):
    @abstractmethod
    async def apply(self, worker_id: str, events: KVEvents) -> None: ...

    @abstractmethod
    async def replace(
        self,
        worker_id: str,
        block_hashes: Sequence[BlockHash],
        tier: CacheTier = CacheTier.DEVICE,
    ) -> None: ...

    @abstractmethod
    async def remove_worker(self, worker_id: str) -> None: ...

    @abstractmethod
    async def longest_prefixes(
        self,
        block_hashes: Sequence[BlockHash],
        worker_ids: Sequence[str],
        tiers: Sequence[CacheTier] = DEVICE_ONLY,
    ) -> dict[str, int]:
        """For each worker, how many leading blocks of ``block_hashes`` it holds in any of
        ``tiers`` (it stops at the first missing block: later hits cannot be reused without
        it)."""

    @abstractmethod
    async def prefix_hits(
        self, block_hashes: Sequence[BlockHash], worker_ids: Sequence[str]
    ) -> dict[str, PrefixHits]:
        """For each worker, ``longest_prefixes`` over the device tier and over both tiers, in
        one lookup (the router's, once per request)."""

    async def close(self) -> None:
        return None


def leading_hits(held: set[BlockHash] | frozenset[BlockHash], hashes: Sequence[BlockHash]) -> int:
    n = 0
    for block_hash in hashes:
        if block_hash not in held:
            break
        n += 1
    return n


class InMemoryPrefixIndex(PrefixIndex):
    """One process's index (tests, single-router setups without Redis)."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, CacheTier], set[BlockHash]] = {}

    async def apply(self, worker_id: str, events: KVEvents) -> None:
        held = self._held.setdefault((worker_id, events.tier), set())
        if events.cleared:
            held.clear()
        held.update(events.stored)
        held.difference_update(events.removed)

    async def replace(
        self,
        worker_id: str,
        block_hashes: Sequence[BlockHash],
        tier: CacheTier = CacheTier.DEVICE,
    ) -> None:
        self._held[worker_id, tier] = set(block_hashes)

    async def remove_worker(self, worker_id: str) -> None:
        for tier in CacheTier:
            self._held.pop((worker_id, tier), None)

    async def longest_prefixes(
        self,
        block_hashes: Sequence[BlockHash],
        worker_ids: Sequence[str],
        tiers: Sequence[CacheTier] = DEVICE_ONLY,
    ) -> dict[str, int]:
        def held(worker_id: str) -> set[BlockHash]:
            return set().union(*(self._held.get((worker_id, t), set()) for t in tiers))

        return {w: leading_hits(held(w), block_hashes) for w in worker_ids}

    async def prefix_hits(
        self, block_hashes: Sequence[BlockHash], worker_ids: Sequence[str]
    ) -> dict[str, PrefixHits]:
        device = await self.longest_prefixes(block_hashes, worker_ids)
        either = await self.longest_prefixes(block_hashes, worker_ids, ANY_TIER)
        return {w: PrefixHits(device[w], either[w]) for w in worker_ids}
