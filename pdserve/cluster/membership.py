"""A worker's presence in the cluster: it heartbeats its registry record, publishes its KV
events to the prefix index, and watches for a drain request.

Redis trouble never stops serving: the loop keeps retrying, and after a reconnect it publishes
a full snapshot of the cache, so the index heals after a Redis restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Protocol

from redis.exceptions import RedisError

from engine.block_hash import BlockHash
from engine.kv_events import CacheTier, KVEvents
from pdserve.cluster.config import RedisConfig, connect
from pdserve.cluster.redis_prefix_index import RedisPrefixIndex
from pdserve.cluster.registry import Registry, WorkerRecord
from pdserve.common import metrics

logger = logging.getLogger(__name__)

# A dead worker's index entries outlive its registry record a while (routers ignore them
# once the record is gone), then Redis drops them.
_INDEX_TTL_FACTOR = 10


class CachedBlocks(Protocol):
    """What a member publishes to the prefix index: a worker's engine (``ServingEngine``), or
    a KV store's pool."""

    collect_kv_events: bool

    def take_kv_events(self) -> list[KVEvents]: ...

    async def snapshot_cached_hashes(self) -> dict[CacheTier, list[BlockHash]]: ...


class Membership:
    def __init__(
        self,
        config: RedisConfig,
        engine: CachedBlocks,
        record: Callable[[], WorkerRecord],
        on_drain_request: Callable[[], None],
    ) -> None:
        self.config = config
        self.engine = engine
        self.record = record
        self.on_drain_request = on_drain_request
        redis = connect(config.url, password=config.password)
        self.registry = Registry(redis, config.namespace, config.ttl_s)
        self.index = RedisPrefixIndex(redis, config.namespace)
        self._redis = redis
        self._task: asyncio.Task[None] | None = None
        self._beat_now = asyncio.Event()
        self._stopping = False

    @property
    def worker_id(self) -> str:
        return self.record().worker_id

    def start(self) -> None:
        self.engine.collect_kv_events = True
        self._task = asyncio.create_task(self._run(), name="cluster-membership")

    def heartbeat_now(self) -> None:
        """Publish the record at once (e.g. the state turned DRAINING)."""
        self._beat_now.set()

    async def stop(self) -> None:
        """Leaves the cluster: no more routing to this worker, no stale index entries."""
        # Asked to finish rather than cancelled: on Python 3.11 a cancel that lands while the
        # loop's wait is completing can be swallowed, and stop() would wait forever.
        self._stopping = True
        self._beat_now.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(self.config.ttl_s):
                await self.registry.deregister(self.worker_id)
                await self.index.remove_worker(self.worker_id)
        await self._redis.aclose()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        need_snapshot, next_beat = True, 0.0
        wait_s = self.config.publish_interval_s
        while not self._stopping:
            try:
                index_ttl_s = _INDEX_TTL_FACTOR * self.config.ttl_s
                if need_snapshot:
                    snapshot = await self.engine.snapshot_cached_hashes()
                    await self.index.publish_snapshot(self.worker_id, snapshot, index_ttl_s)
                    need_snapshot = False
                for events in self.engine.take_kv_events():
                    await self.index.apply(self.worker_id, events)
                if self._beat_now.is_set() or loop.time() >= next_beat:
                    self._beat_now.clear()
                    await self.registry.heartbeat(self.record())
                    next_beat = loop.time() + self.config.heartbeat_s
                    if not await self.index.keep_alive(self.worker_id, index_ttl_s):
                        # Our snapshot vanished (Redis restarted empty), whatever events since
                        # have written there: publish the whole cache again.
                        need_snapshot = True
                    if await self.registry.drain_requested(self.worker_id):
                        self.on_drain_request()
                metrics.REDIS_UP.set(1)
                wait_s = self.config.publish_interval_s
            except (RedisError, OSError) as exc:
                if not need_snapshot:
                    logger.warning("redis unavailable (%s); serving continues", exc)
                metrics.REDIS_UP.set(0)
                # Whatever was not published is covered by the snapshot after reconnecting.
                need_snapshot = True
                self.engine.take_kv_events()
                # Retried at the heartbeat's pace: a refused connection fails at once, and an
                # early beat asked for (a drain) would otherwise turn this into a busy loop.
                self._beat_now.clear()
                wait_s = self.config.heartbeat_s
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self._beat_now.wait()
