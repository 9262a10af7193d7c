"""`pdserve status` and `pdserve drain`: the registry as operators see and steer it."""

from __future__ import annotations

import time

from pdserve.cluster.config import RedisConfig, connect
from pdserve.cluster.redis_prefix_index import RedisPrefixIndex
from pdserve.cluster.registry import Registry

_COLUMNS = ("ROLE", "WORKER", "ADDRESS", "STATE", "RUN", "QUEUE", "KV USED/TOTAL", "INDEXED", "AGE")


async def status_table(config: RedisConfig) -> str:
    redis = connect(config.url, timeout_s=5.0, password=config.password)
    try:
        records = await Registry(redis, config.namespace, config.ttl_s).workers()
        index = RedisPrefixIndex(redis, config.namespace)
        indexed = [await index.num_blocks(r.worker_id) for r in records]
    finally:
        await redis.aclose()
    now = time.time()
    rows = [
        (
            r.role.value,
            r.worker_id,
            r.address,
            r.state.value,
            str(r.num_running),
            str(r.num_waiting),
            f"{r.num_blocks - r.num_free_blocks}/{r.num_blocks}",
            str(n),
            f"{now - r.heartbeat_unix_s:.1f}s",
        )
        for r, n in sorted(zip(records, indexed, strict=True), key=lambda x: x[0].role.value)
    ]
    widths = [max([len(c), *(len(row[i]) for row in rows)]) for i, c in enumerate(_COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    header = "  ".join(c.ljust(w) for c, w in zip(_COLUMNS, widths, strict=True))
    return "\n".join([header, *lines]) if rows else "no workers registered"


async def request_drain(config: RedisConfig, worker_id: str) -> bool:
    redis = connect(config.url, timeout_s=5.0, password=config.password)
    try:
        return await Registry(redis, config.namespace, config.ttl_s).request_drain(worker_id)
    finally:
        await redis.aclose()
