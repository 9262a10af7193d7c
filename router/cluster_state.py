"""The router's use of Redis: worker discovery (registry) and prefix lookups (index).

Redis is an accelerator: every Redis failure degrades to load-only routing over the last known
workers (``pdserve_redis_up`` says so), and discovery resumes by itself when Redis returns.
"""

from __future__ import annotations

import asyncio
import logging

from redis.asyncio import Redis
from redis.exceptions import RedisError

from engine.block_hash import hash_blocks, root_hash
from pdserve.cluster.config import RedisConfig, connect
from pdserve.cluster.last_known import LastKnownWorkers
from pdserve.cluster.redis_prefix_index import RedisPrefixIndex
from pdserve.cluster.registry import Registry
from pdserve.common import metrics
from router.policy import host_credited_tokens
from router.prefix_pricing import Holding
from router.worker import Worker
from router.worker_pool import WorkerPool

logger = logging.getLogger(__name__)

_DISCOVERY_INTERVAL_S = 0.5
_WAIT_LOG_S = 10.0


class ClusterState:
    def __init__(
        self, config: RedisConfig | None, pool: WorkerPool, fingerprint: str, block_size: int
    ) -> None:
        self.config = config
        self.pool = pool
        self.fingerprint = fingerprint
        self.block_size = block_size
        # The same root and hasher as every engine with this fingerprint (engine.block_hash).
        self.root = root_hash(fingerprint)
        self._redis: Redis | None = None
        self.registry: Registry | None = None
        self.index: RedisPrefixIndex | None = None
        self.last_known = LastKnownWorkers(config.last_known_file if config else None)
        self._discovered = False  # the registry was read at least once since start
        if config is not None:
            self._redis = connect(config.url, password=config.password)
            self.registry = Registry(self._redis, config.namespace, config.ttl_s)
            self.index = RedisPrefixIndex(self._redis, config.namespace)
        self._up = True
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def _set_up(self, up: bool, exc: Exception | None = None) -> None:
        metrics.REDIS_UP.set(1 if up else 0)
        if self._up and not up:
            logger.warning("redis unavailable (%s): routing on load over known workers", exc)
        elif up and not self._up:
            logger.info("redis reachable again: discovery and cache-aware routing resume")
        self._up = up

    async def discover(self) -> None:
        if self.registry is None:
            return
        try:
            records = await self.registry.workers()
        except (RedisError, OSError) as exc:
            self._set_up(False, exc)
            if not self._discovered:
                # Started during an outage: the workers known before the restart are
                # candidates, routable once they answer GetStats with our layout.
                self._discovered = True
                remembered = self.last_known.load()
                if remembered:
                    logger.warning("routing to %d last-known workers", len(remembered))
                    self.pool.sync(
                        remembered, self.fingerprint, self.block_size, heartbeating=False
                    )
            return
        self._set_up(True)
        self._discovered = True
        self.pool.sync(records, self.fingerprint, self.block_size)
        self.last_known.save(records)
        await self.pool.close_unused_channels()

    async def wait_ready(
        self, timeout_s: float | None, needs_prefill: bool = True, poll_s: float = 0.1
    ) -> None:
        """Until a decode worker (and a prefill worker, if needed) answers; TimeoutError past
        ``timeout_s`` (None: no bound: a cold GPU load can take long, and a router that exits
        would only crash-loop). What it waits for is logged every ``_WAIT_LOG_S``."""
        loop = asyncio.get_running_loop()
        next_log = loop.time() + _WAIT_LOG_S
        async with asyncio.timeout(timeout_s):
            while True:
                await self.discover()
                await self.pool.refresh(self.fingerprint, self.block_size)
                if self.pool.ready(needs_prefill):
                    return
                if loop.time() >= next_log:
                    next_log = loop.time() + _WAIT_LOG_S
                    logger.warning(
                        "waiting for workers: %s; redis %s",
                        self.pool.readiness(needs_prefill),
                        "up" if self._up else "unreachable",
                    )
                await asyncio.sleep(poll_s)

    def start(self, stats_interval_s: float) -> None:
        async def run() -> None:
            loop = asyncio.get_running_loop()
            next_stats = loop.time()
            while not self._stopping:
                try:
                    await self.discover()
                    if loop.time() >= next_stats:
                        await self.pool.refresh(self.fingerprint, self.block_size)
                        next_stats = loop.time() + stats_interval_s
                except Exception:  # the loop must outlive any one bad round
                    logger.exception("cluster state refresh failed")
                await asyncio.sleep(_DISCOVERY_INTERVAL_S)

        self._task = asyncio.create_task(run(), name="cluster-state")

    async def cached_tokens(self, prompt_ids: list[int], workers: list[Worker]) -> dict[str, int]:
        """Predicted prefix-cache hit tokens per worker address, or {} without an index. A
        block a worker holds only in its host tier counts ``HOST_HIT_CREDIT`` of a device hit:
        it is copied back rather than recomputed (cheaper than a miss, dearer than a device
        hit)."""
        holdings = await self.prefix_holdings(prompt_ids, workers)
        return {
            address: host_credited_tokens(h.device_blocks, h.any_tier_blocks, self.block_size)
            for address, h in holdings.items()
        }

    async def prefix_holdings(
        self, prompt_ids: list[int], workers: list[Worker]
    ) -> dict[str, Holding]:
        """What each worker caches of the prompt, in leading whole blocks per tier, or {}
        without an index. Like the engine, the last prompt token is never counted: it must be
        computed."""
        if self.index is None or not workers or not self._up:
            return {}  # while Redis is down, discovery (every 0.5 s) notices its return
        usable = (len(prompt_ids) - 1) // self.block_size * self.block_size
        hashes = hash_blocks(self.root, prompt_ids[:usable], self.block_size)
        try:
            ids = [w.worker_id for w in workers]
            hits = await self.index.prefix_hits(hashes, ids)
        except (RedisError, OSError) as exc:
            self._set_up(False, exc)
            return {}
        self._set_up(True)
        return {
            w.address: Holding(
                hits[w.worker_id].num_device_blocks, hits[w.worker_id].num_any_tier_blocks
            )
            for w in workers
        }

    async def close(self) -> None:
        # Stopped by flag, not cancel: a cancel can be lost inside redis-py's wait_for on 3.11.
        self._stopping = True
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        if self._redis is not None:
            await self._redis.aclose()
