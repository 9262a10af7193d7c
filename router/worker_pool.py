"""The router's view of its workers: stubs, in-flight counts, and periodically refreshed stats."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from pdserve.channels import ChannelPool
from pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from router.policy import WorkerLoad, rank_decode, rank_prefill

logger = logging.getLogger(__name__)

_STATS_TIMEOUT_S = 2.0


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class Worker:
    address: str
    role: Role
    channel: grpc.aio.Channel
    num_inflight: int = 0
    stats: common_pb2.WorkerStats | None = None
    healthy: bool = False
    prefill: prefill_pb2_grpc.PrefillWorkerStub = field(init=False)
    decode: decode_pb2_grpc.DecodeWorkerStub = field(init=False)

    def __post_init__(self) -> None:
        self.prefill = prefill_pb2_grpc.PrefillWorkerStub(self.channel)
        self.decode = decode_pb2_grpc.DecodeWorkerStub(self.channel)

    def load(self) -> WorkerLoad:
        stats = self.stats
        return WorkerLoad(
            address=self.address,
            num_inflight=self.num_inflight,
            num_free_blocks=stats.num_free_blocks if stats else 0,
            num_blocks=stats.num_blocks if stats else 0,
            block_size=stats.block_size if stats and stats.block_size else 1,
            healthy=self.healthy and not (stats and stats.draining),
        )

    async def refresh(self) -> None:
        stub = self.prefill if self.role is Role.PREFILL else self.decode
        try:
            self.stats = await stub.GetStats(common_pb2.GetStatsRequest(), timeout=_STATS_TIMEOUT_S)
            self.healthy = True
        except grpc.aio.AioRpcError as exc:
            # A slow answer is a busy worker, not a dead one; keep its last state.
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and self.stats is not None:
                return
            if self.healthy:
                logger.warning(
                    "%s worker %s unhealthy: %s", self.role.value, self.address, exc.code().name
                )
            self.healthy = False


class WorkerPool:
    def __init__(self, prefill: tuple[str, ...], decode: tuple[str, ...]) -> None:
        self._channels = ChannelPool()
        self.prefill = {a: Worker(a, Role.PREFILL, self._channels.get(a)) for a in prefill}
        self.decode = {a: Worker(a, Role.DECODE, self._channels.get(a)) for a in decode}
        self._turn = 0

    @property
    def workers(self) -> list[Worker]:
        return [*self.prefill.values(), *self.decode.values()]

    async def refresh(self) -> None:
        await asyncio.gather(*(w.refresh() for w in self.workers))

    async def wait_ready(self, timeout_s: float, poll_s: float = 0.2) -> None:
        """Until at least one prefill and one decode worker answer; TimeoutError otherwise."""
        async with asyncio.timeout(timeout_s):
            while True:
                await self.refresh()
                if any(w.healthy for w in self.prefill.values()) and any(
                    w.healthy for w in self.decode.values()
                ):
                    return
                await asyncio.sleep(poll_s)

    async def refresh_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.refresh()

    @property
    def max_model_len(self) -> int:
        """The smallest limit among workers that reported one (both phases must fit)."""
        lens = [w.stats.max_model_len for w in self.workers if w.stats is not None]
        return min(lens) if lens else 0

    def ranked_prefill(self) -> list[Worker]:
        self._turn += 1
        order = rank_prefill([w.load() for w in self.prefill.values()], self._turn)
        return [self.prefill[a] for a in order]

    def ranked_decode(self, num_prompt_tokens: int) -> list[Worker]:
        self._turn += 1
        loads = [w.load() for w in self.decode.values()]
        return [self.decode[a] for a in rank_decode(loads, num_prompt_tokens, self._turn)]

    @contextlib.contextmanager
    def dispatched(self, worker: Worker) -> Iterator[Worker]:
        worker.num_inflight += 1
        try:
            yield worker
        finally:
            worker.num_inflight -= 1

    async def close(self) -> None:
        await self._channels.close()
