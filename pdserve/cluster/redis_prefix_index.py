"""The prefix index in Redis: one set of raw 16-byte block hashes per worker and tier.

``longest_prefixes`` and ``prefix_hits`` are one round trip each for any prompt length and
any number of workers (a Lua script walks each worker's sets in prompt order); ``apply`` and
``replace`` are one pipelined transaction each.

A worker's snapshot (``publish_snapshot``: every tier and a marker, in one transaction) is what
``keep_alive`` checks for: the marker is written by nothing else, so a Redis that restarted
empty is seen even after the worker's newer events have recreated some of its sets there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from redis.asyncio import Redis

from engine.block_hash import BlockHash
from engine.kv_events import CacheTier, KVEvents
from pdserve.cluster.config import connect
from pdserve.cluster.prefix_index import DEVICE_ONLY, PrefixHits, PrefixIndex

# KEYS: per worker, one set per tier asked about. ARGV[1]: how many tiers; then the prompt's
# block hashes, in order. Returns, per worker, the number of leading hashes any of its sets holds.
_LONGEST_PREFIXES = """
local per = tonumber(ARGV[1])
local out = {}
for i = 1, #KEYS / per do
  local n = 0
  for j = 2, #ARGV do
    local found = false
    for t = 1, per do
      if redis.call('SISMEMBER', KEYS[(i - 1) * per + t], ARGV[j]) == 1 then
        found = true
        break
      end
    end
    if not found then break end
    n = j - 1
  end
  out[i] = n
end
return out
"""

# KEYS: per worker, its device set then its host set. ARGV: the prompt's block hashes, in
# order. Returns, per worker, the leading hashes its device set holds, then those either holds.
_PREFIX_HITS = """
local out = {}
for i = 1, #KEYS / 2 do
  local device, host = KEYS[2 * i - 1], KEYS[2 * i]
  local num_device, num_any = 0, 0
  for j = 1, #ARGV do
    local on_device = redis.call('SISMEMBER', device, ARGV[j]) == 1
    if not on_device and redis.call('SISMEMBER', host, ARGV[j]) == 0 then break end
    if on_device and num_device == j - 1 then num_device = j end
    num_any = j
  end
  out[2 * i - 1] = num_device
  out[2 * i] = num_any
end
return out
"""


class RedisPrefixIndex(PrefixIndex):
    def __init__(self, redis: Redis, namespace: str = "pdserve") -> None:
        self.redis = redis
        self.namespace = namespace
        self._lookup = redis.register_script(_LONGEST_PREFIXES)
        self._hits = redis.register_script(_PREFIX_HITS)

    @classmethod
    def from_url(cls, url: str, namespace: str = "pdserve") -> RedisPrefixIndex:
        return cls(connect(url), namespace)

    def _key(self, worker_id: str, tier: CacheTier = CacheTier.DEVICE) -> str:
        # The device tier keeps the key it always had: an index written before tiers reads on.
        suffix = "" if tier is CacheTier.DEVICE else f":{tier.value}"
        return f"{self.namespace}:prefix:{worker_id}{suffix}"

    async def apply(self, worker_id: str, events: KVEvents) -> None:
        if events.empty:
            return
        key = self._key(worker_id, events.tier)
        async with self.redis.pipeline(transaction=True) as pipe:
            if events.cleared:
                pipe.delete(key)
            if events.stored:
                pipe.sadd(key, *events.stored)
            if events.removed:
                pipe.srem(key, *events.removed)
            await pipe.execute()

    async def replace(
        self,
        worker_id: str,
        block_hashes: Sequence[BlockHash],
        tier: CacheTier = CacheTier.DEVICE,
    ) -> None:
        key = self._key(worker_id, tier)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            if block_hashes:
                pipe.sadd(key, *block_hashes)
            await pipe.execute()

    async def remove_worker(self, worker_id: str) -> None:
        await self.redis.delete(*self._worker_keys(worker_id))

    def _worker_keys(self, worker_id: str) -> list[str]:
        return [*(self._key(worker_id, t) for t in CacheTier), self._snapshot_key(worker_id)]

    def _snapshot_key(self, worker_id: str) -> str:
        return f"{self.namespace}:prefix:{worker_id}:snapshot"

    async def publish_snapshot(
        self,
        worker_id: str,
        snapshot: Mapping[CacheTier, Sequence[BlockHash]],
        ttl_s: float,
    ) -> None:
        """Replaces every tier of the worker with ``snapshot`` and marks it published (the
        marker ``keep_alive`` checks), all or nothing: a restart cannot land between them."""
        ttl_ms = int(ttl_s * 1000)
        async with self.redis.pipeline(transaction=True) as pipe:
            for tier in CacheTier:
                key = self._key(worker_id, tier)
                pipe.delete(key)
                if hashes := snapshot.get(tier):
                    pipe.sadd(key, *hashes)
                    pipe.pexpire(key, ttl_ms)
            pipe.set(self._snapshot_key(worker_id), b"1", px=ttl_ms)
            await pipe.execute()

    async def longest_prefixes(
        self,
        block_hashes: Sequence[BlockHash],
        worker_ids: Sequence[str],
        tiers: Sequence[CacheTier] = DEVICE_ONLY,
    ) -> dict[str, int]:
        if not worker_ids:
            return {}
        if not block_hashes:
            return dict.fromkeys(worker_ids, 0)
        keys = [self._key(w, t) for w in worker_ids for t in tiers]
        counts = await self._lookup(keys=keys, args=[len(tiers), *block_hashes])
        return {w: int(n) for w, n in zip(worker_ids, counts, strict=True)}

    async def prefix_hits(
        self, block_hashes: Sequence[BlockHash], worker_ids: Sequence[str]
    ) -> dict[str, PrefixHits]:
        if not block_hashes:
            return {w: PrefixHits(0, 0) for w in worker_ids}
        if not worker_ids:
            return {}
        keys = [self._key(w, t) for w in worker_ids for t in (CacheTier.DEVICE, CacheTier.HOST)]
        counts = [int(n) for n in await self._hits(keys=keys, args=list(block_hashes))]
        return {w: PrefixHits(*counts[2 * i : 2 * i + 2]) for i, w in enumerate(worker_ids)}

    async def keep_alive(self, worker_id: str, ttl_s: float) -> bool:
        """Entries of a worker that dies without deregistering expire after ``ttl_s`` (routers
        already ignore them: they only ask about live workers). False when the worker's last
        snapshot is gone (Redis restarted empty, or the entries expired): publish one again."""
        ttl_ms = int(ttl_s * 1000)
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in self._worker_keys(worker_id):
                pipe.pexpire(key, ttl_ms)
            *_, marked = await pipe.execute()
        return bool(marked)

    async def num_blocks(self, worker_id: str) -> int:
        return int(await self.redis.scard(self._key(worker_id)))

    async def close(self) -> None:
        await self.redis.aclose()
