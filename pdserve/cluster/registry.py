"""The worker registry in Redis: who is serving, where, with which KV layout, and how busy.

Each worker writes its record every ``heartbeat_s``; the record expires after ``ttl_s`` (so a
worker that dies leaves routing within the TTL). Records are flat Redis hashes of strings,
parsed into ``WorkerRecord`` with validation: nothing is pickled.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import asdict, dataclass, fields

from redis.asyncio import Redis

from pdserve.cluster.config import DEFAULT_TTL_S, connect
from pdserve.common.role import Role
from pdserve.common.wire_version import WIRE_VERSION

logger = logging.getLogger(__name__)


class WorkerState(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"


@dataclass(frozen=True)
class WorkerRecord:
    worker_id: str
    role: Role
    address: str
    model_fingerprint: str
    block_size: int
    num_blocks: int
    state: WorkerState = WorkerState.SERVING
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0
    kv_address: str = ""  # a prefill worker's KV sender: decode workers pull only from these
    heartbeat_unix_s: float = 0.0
    # Its internal wire's (pdserve/common/wire_version.py); a record without one is older: 0.
    wire_version: int = WIRE_VERSION

    def to_redis(self) -> dict[str, str]:
        out = {k: str(v) for k, v in asdict(self).items()}
        out["role"], out["state"] = self.role.value, self.state.value
        return out

    @classmethod
    def from_redis(cls, raw: dict[bytes, bytes]) -> WorkerRecord:
        """Raises ValueError on a malformed record (named field)."""
        values = {k.decode(): v.decode() for k, v in raw.items()}
        kwargs: dict[str, object] = {}
        values.setdefault("wire_version", "0")  # a worker from before versions were sent
        for f in fields(cls):
            if f.name not in values:
                raise ValueError(f"worker record lacks {f.name}")
            text = values[f.name]
            try:
                if f.name == "role":
                    kwargs[f.name] = Role(text)
                    if not Role(text).is_worker:
                        raise ValueError(text)
                elif f.name == "state":
                    kwargs[f.name] = WorkerState(text)
                elif f.type in ("int", int):
                    kwargs[f.name] = int(text)
                elif f.type in ("float", float):
                    kwargs[f.name] = float(text)
                else:
                    kwargs[f.name] = text
            except ValueError:
                raise ValueError(f"worker record field {f.name} = {text!r} is invalid") from None
        return cls(**kwargs)  # type: ignore[arg-type]


class Registry:
    def __init__(self, redis: Redis, namespace: str = "pdserve", ttl_s: float = DEFAULT_TTL_S):
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.redis = redis
        self.namespace = namespace
        self.ttl_s = ttl_s

    def _key(self, worker_id: str) -> str:
        return f"{self.namespace}:worker:{worker_id}"

    @property
    def _members(self) -> str:
        return f"{self.namespace}:workers"

    def _drain_key(self, worker_id: str) -> str:
        return f"{self.namespace}:drain:{worker_id}"

    async def heartbeat(self, record: WorkerRecord) -> None:
        record = WorkerRecord(**{**asdict(record), "heartbeat_unix_s": time.time()})
        key = self._key(record.worker_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=record.to_redis())  # type: ignore[arg-type]
            pipe.pexpire(key, int(self.ttl_s * 1000))
            pipe.sadd(self._members, record.worker_id)
            await pipe.execute()

    async def deregister(self, worker_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._key(worker_id), self._drain_key(worker_id))
            pipe.srem(self._members, worker_id)
            await pipe.execute()

    async def workers(self) -> list[WorkerRecord]:
        """Live workers (expired records are dropped from the member set on the way)."""
        members = await self.redis.smembers(self._members)
        ids = sorted(m.decode() if isinstance(m, bytes) else m for m in members)
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for worker_id in ids:
                pipe.hgetall(self._key(worker_id))
            raws = await pipe.execute()
        records, gone = [], []
        for worker_id, raw in zip(ids, raws, strict=True):
            if not raw:
                gone.append(worker_id)
                continue
            try:
                records.append(WorkerRecord.from_redis(raw))
            except ValueError as exc:  # e.g. a worker of another version: skip, keep the rest
                logger.warning("ignoring worker_id=%s: %s", worker_id, exc)
        if gone:
            await self.redis.srem(self._members, *gone)
        return records

    @staticmethod
    async def workers_at(url: str, namespace: str = "pdserve") -> list[WorkerRecord]:
        """One-shot read of the live workers (tools and tests)."""
        redis = connect(url, timeout_s=5.0)
        try:
            return await Registry(redis, namespace).workers()
        finally:
            await redis.aclose()

    async def request_drain(self, worker_id: str) -> bool:
        """Asks a worker to drain (it polls with its heartbeat). False if no such worker."""
        if not await self.redis.exists(self._key(worker_id)):
            return False
        await self.redis.set(self._drain_key(worker_id), b"1", px=int(max(self.ttl_s, 60) * 1000))
        return True

    async def drain_requested(self, worker_id: str) -> bool:
        return bool(await self.redis.exists(self._drain_key(worker_id)))
