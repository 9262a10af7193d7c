"""The prefill worker's gRPC service: prefill-only engine, leases, KV sender.

Block ownership: the engine pins a request's blocks when its first token is sampled; the lease
table then owns the single ``release`` of them (decode confirmed, lease expired, or abort).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from engine.outputs import RequestUpdate
from kvtransfer import BlockLeases, KVSender, make_sender
from pdserve import metrics
from pdserve.async_engine import EngineDeadError
from pdserve.cluster.registry import Role
from pdserve.convert import (
    finish_reason_to_proto,
    handle_to_proto,
    logprobs_to_proto,
)
from pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from pdserve.worker import WorkerService
from prefill_service.config import PrefillConfig
from prefill_service.lease_table import LeaseTable

logger = logging.getLogger(__name__)


class PrefillService(WorkerService, BlockLeases, prefill_pb2_grpc.PrefillWorkerServicer):
    role = Role.PREFILL
    name = "pdserve.v1.PrefillWorker"

    def __init__(self, config: PrefillConfig) -> None:
        super().__init__(config.engine, config.redis, config.worker_id)
        self.config = config
        self.leases = LeaseTable(config.lease_s)
        self._leases_changed = asyncio.Event()
        self._sender: KVSender | None = None
        self._reaper: asyncio.Task[None] | None = None

    def register(self, server: grpc.aio.Server) -> None:
        prefill_pb2_grpc.add_PrefillWorkerServicer_to_server(self, server)

    async def load(self) -> None:
        await super().load()
        self._sender = make_sender(
            self.config.kv_backend,
            self.engine.engine.kv_cache,
            self,
            self.config.server.host,
            self.config.kv_port,
            advertise_host=self.config.server.advertise_host,
        )
        await self._sender.start()
        self._reaper = asyncio.create_task(self._expire_leases(), name="lease-reaper")
        logger.info("kv sender (%s) at %s", self._sender.backend, self._sender.address)

    def num_inflight(self) -> int:
        return super().num_inflight() + len(self.leases)

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        if self._sender is not None:
            await self._sender.stop()
        for request_id in self.leases.expire(float("inf")):
            await self._free(request_id)
        await super().close()

    # ---- RPCs ------------------------------------------------------------------------------
    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        request_id = request.request_id
        params = await self.accept(context, request_id, request.sampling)
        llm_engine = self.engine.engine
        prompt = list(request.prompt_token_ids)

        def admit() -> None:
            llm_engine.add_request(prompt, params, request_id, prefill_only=True)

        with self.admitted():
            last: RequestUpdate | None = None
            try:
                async with contextlib.aclosing(self.engine.stream(request_id, admit)) as updates:
                    async for update in updates:
                        last = update
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except EngineDeadError as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            assert last is not None and last.prefilled
            # Pinned now: lease the blocks before the next await, so that no cancellation can
            # strand them. (A pinned request is never touched by a step: no lock needed.)
            exported = llm_engine.export_prefilled(request_id)
            self.leases.grant(request_id, exported.block_ids, self._now())
            self._leases_changed.set()
            response = prefill_pb2.PrefillResponse(
                request_id=request_id,
                first_token_id=exported.first_token_id,
                num_cached_tokens=last.num_cached_tokens,
                finish_reason=finish_reason_to_proto(last.finish_reason),
            )
            if exported.first_token_logprobs is not None:
                response.first_token_logprobs.CopyFrom(
                    logprobs_to_proto(exported.first_token_logprobs)
                )
            if last.finished:
                # The first token ended the request: nothing to decode, nothing to lease.
                await self._release(request_id)
                return response
            assert self._sender is not None
            handle = self._sender.handle(request_id, len(exported.block_ids), self.config.lease_s)
            response.handle.CopyFrom(handle_to_proto(handle))
            return response

    async def Release(
        self, request: prefill_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.ReleaseResponse:
        return prefill_pb2.ReleaseResponse(released=await self._release(request.request_id))

    async def RenewLease(
        self, request: prefill_pb2.RenewLeaseRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.RenewLeaseResponse:
        renewed = self.leases.renew(request.request_id, self._now())
        return prefill_pb2.RenewLeaseResponse(renewed=renewed, lease_s=self.config.lease_s)

    async def GetStats(
        self, request: common_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.WorkerStats:
        return self.stats()

    # ---- leases (BlockLeases, for the KV sender) -------------------------------------------
    def checkout(self, request_id: str) -> list[int]:
        return self.leases.checkout(request_id)

    async def checkin(self, request_id: str) -> None:
        if self.leases.checkin(request_id):
            await self._free(request_id)
        self._leases_changed.set()

    async def _release(self, request_id: str) -> bool:
        leased, free_now = self.leases.release(request_id)
        if free_now:
            await self._free(request_id)
        return leased

    async def _free(self, request_id: str) -> None:
        # Shielded: a cancelled caller must not leave the blocks pinned.
        await asyncio.shield(self.engine.call(lambda: self.engine.engine.release(request_id)))
        if self._sender is not None:
            self._sender.lease_ended(request_id)
        metrics.LEASED_REQUESTS.set(len(self.leases))

    async def _expire_leases(self) -> None:
        while True:
            metrics.LEASED_REQUESTS.set(len(self.leases))
            deadline = self.leases.next_deadline_s()
            timeout = None if deadline is None else max(deadline - self._now(), 0.0)
            self._leases_changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._leases_changed.wait()
            for request_id in self.leases.expire(self._now()):
                logger.warning("request_id=%s lease expired; freeing its blocks", request_id)
                metrics.LEASES_EXPIRED.inc()
                try:
                    await self._free(request_id)
                except Exception:  # the reaper must outlive one bad free
                    logger.exception("request_id=%s freeing an expired lease failed", request_id)

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()
