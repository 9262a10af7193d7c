"""The prefill worker's gRPC service: prefill-only engine, leases, KV sender.

The engine pins a request's blocks when its first token is sampled; the ``LeaseManager`` then
owns their one free (see ``kvtransfer/lease_manager.py`` and the contract in
``kvtransfer/base.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import replace

import grpc

from engine.outputs import RequestUpdate
from engine.sampling_params import SamplingParams
from engine.serving_engine import EngineBuilder, EngineDeadError, PeerPullUnsupported
from kvtransfer import KVSender, ReceiverOptions, SenderOptions
from kvtransfer.base import prompt_digest
from kvtransfer.lease_manager import LeaseManager
from kvtransfer.prefix_holder import PrefixHolderRpcs, lease_prefix_refusal, prefix_lease
from kvtransfer.prefix_pull import PrefixPuller
from kvtransfer.sharded import engine_receiver, engine_sender
from kvtransfer.wire import handle_to_proto
from pdserve.cluster.registry import WorkerRecord
from pdserve.common import metrics, tracing
from pdserve.common.channels import ChannelPool
from pdserve.common.convert import finish_reason_to_proto, logprobs_to_proto
from pdserve.common.lease_release import LeaseReleaser
from pdserve.common.role import Role
from pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from pdserve.worker.peers import PeerDirectory
from pdserve.worker.service import WorkerService
from pdserve.worker.store_offload import StoreOffloader
from prefill_service.config import PrefillConfig

logger = logging.getLogger(__name__)


class PrefillService(PrefixHolderRpcs, WorkerService, prefill_pb2_grpc.PrefillWorkerServicer):
    role = Role.PREFILL
    name = "pdserve.v1.PrefillWorker"

    def __init__(self, config: PrefillConfig, build_engine: EngineBuilder) -> None:
        super().__init__(config.engine, config.redis, config.worker_id, build_engine=build_engine)
        self.config = config
        self.leases = LeaseManager(config.lease_s)
        self._sender: KVSender | None = None
        # Peer pull (kvtransfer/prefix_pull.py): the receiver is made at the first pull.
        self._channels = ChannelPool(tls=config.server.tls)
        self._releaser = LeaseReleaser(self._channels)
        self._peers: PeerDirectory | None = None
        self._puller: PrefixPuller | None = None
        self._puller_lock = asyncio.Lock()
        self._offloader: StoreOffloader | None = None

    def register(self, server: grpc.aio.Server) -> None:
        prefill_pb2_grpc.add_PrefillWorkerServicer_to_server(self, server)

    async def load(self) -> None:
        await super().load()
        # Offload to KV stores: what the host tier evicts (an engine without one spills none).
        offloader = StoreOffloader(
            lambda: self.directory().stores(),
            self._channels,
            self.engine.kv_layout,
            self.config.kv_store_replicas,
        )
        if self.engine.spill_evicted(offloader):
            await offloader.start()
            self._offloader = offloader
            metrics.STORE_REPLICAS.set(self.config.kv_store_replicas)

    @property
    def offloader(self) -> StoreOffloader | None:
        """What offloads the host tier's evictions to the KV stores (None: nothing does)."""
        return self._offloader

    def directory(self) -> PeerDirectory:
        """The prefill peers and KV stores it pulls from (and offloads to), made once the
        registry is joined."""
        if self._peers is None:
            registry = self.membership.registry if self.membership is not None else None
            static = self.config.prefill_peers
            self._peers = PeerDirectory(
                static, registry, self._channels, stores=self.config.kv_stores
            )
            self._peers.start()
        return self._peers

    async def prepare(self) -> None:
        # Before the first heartbeat: a record without the KV sender's address would make
        # decode workers refuse this worker's handles (pdserve/worker/peers.py).
        options = SenderOptions(
            self.config.server.host,
            self.config.kv_port,
            advertise_host=self.config.server.advertise_host,
            tls=self.config.server.tls,
            max_pull_s=self.config.max_pull_s,
            verify=self.config.kv_verify,
            ucx_tls=self.config.ucx_tls,
        )
        self._sender = engine_sender(self.engine, self.config.kv_backend, self.leases, options)
        await self._sender.start()
        self.leases.start(self.engine.free_pinned, self._sender)
        logger.info("kv sender (%s) at %s", self._sender.backend, self._sender.address)

    def num_inflight(self) -> int:
        return super().num_inflight() + len(self.leases)

    @property
    def kv_address(self) -> str:
        return self._sender.address if self._sender is not None else ""

    def record(self) -> WorkerRecord:
        return replace(super().record(), kv_address=self.kv_address)

    def stats(self) -> common_pb2.WorkerStats:
        stats = super().stats()
        stats.kv_address = self.kv_address
        return stats

    async def close(self) -> None:
        if self._offloader is not None:
            await self._offloader.stop()
        await self.leases.close()  # the reaper, the sender, then what is still leased
        if self._peers is not None:
            await self._peers.stop()
        await self._releaser.close()
        if self._puller is not None and self._puller.receiver is not None:
            await self._puller.receiver.close()
        await self._channels.close()
        await super().close()

    async def puller(self) -> PrefixPuller:
        """The peer puller, made at the first pull (in a thread: a receiver may register the
        whole cache with its transport)."""
        async with self._puller_lock:
            if self._puller is None:
                options = ReceiverOptions(
                    self.config.max_pull_s,
                    tls=self.config.server.tls,
                    verify=self.config.kv_verify,
                    ucx_tls=self.config.ucx_tls,
                )
                try:
                    receiver = await asyncio.to_thread(
                        engine_receiver, self.engine, self.config.kv_backend, options
                    )
                except Exception:  # no pull then (each counted "unsupported"), never a failure
                    logger.exception("peer pull: no KV receiver; prompts are computed here")
                    receiver = None
                timeout_s = self.config.peer_pull_timeout_s
                self._puller = PrefixPuller(
                    self.engine,
                    receiver,
                    self.directory().kv_sender,
                    self._channels,
                    self._releaser,
                    timeout_s,
                )
            return self._puller

    # ---- RPCs ------------------------------------------------------------------------------
    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        received_s = time.monotonic()
        request_id = request.request_id
        params = await self.accept(context, request_id, request.sampling)
        prompt = list(request.prompt_token_ids)
        await self.check_fits(context, len(prompt))
        self.inject_faults(request_id, prompt)
        with self.in_flight():
            # A pull saves prompt compute; prompt logprobs need every position computed here.
            if not request.HasField("prefix") or params.prompt_logprobs is not None:
                return await self._prefill(request, context, params, received_s)
            pulls = await self.puller()
            async with pulls.pulled(request_id, prompt, request.prefix) as got:
                # The pull (done or failed) is its own phase, not the engine queue's.
                pulled_s = time.monotonic()
                response = await self._prefill(
                    request, context, params, pulled_s, pulled_s - received_s
                )
                response.num_pulled_tokens, response.pull_s = got.num_tokens, got.seconds
                return response

    async def _prefill(
        self,
        request: prefill_pb2.PrefillRequest,
        context: grpc.aio.ServicerContext,
        params: SamplingParams,
        received_s: float,
        pulling_s: float = 0.0,
    ) -> prefill_pb2.PrefillResponse:
        """``received_s``: when the request was ready to queue (after a pull, which took
        ``pulling_s``)."""
        request_id, prompt = request.request_id, list(request.prompt_token_ids)
        last: RequestUpdate | None = None
        stream = self.engine.generate(
            request_id,
            prompt,
            params,
            prefill_only=True,
            num_generated_tokens=request.num_generated_tokens,
        )
        try:
            async with contextlib.aclosing(stream) as updates:
                async for update in updates:
                    last = update
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineDeadError as exc:
            await self.abort_engine_dead(context, exc)
        assert last is not None and last.prefilled
        # Pinned now: lease the blocks before the next await, so that no cancellation can
        # strand them. (A pinned request is never touched by a step: no lock needed.)
        exported = self.engine.export_prefilled(request_id)
        token = self.leases.grant(request_id, exported.block_ids)
        queue_s, compute_s = _split(received_s, last.first_scheduled_s, time.monotonic())
        response = prefill_pb2.PrefillResponse(
            request_id=request_id,
            first_token_id=exported.first_token_id,
            num_cached_tokens=last.num_cached_tokens,
            prompt_logprobs=[logprobs_to_proto(lp) for lp in last.prompt_logprobs],
            queue_s=queue_s,
            compute_s=compute_s,
            num_host_cached_tokens=last.num_host_cached_tokens,
            peer_pull_phase_s=pulling_s,
        )
        phases: tuple[tuple[str, float], ...] = (
            ("prefill_worker.queue", queue_s),
            ("prefill_worker.compute", compute_s),
        )
        if pulling_s:
            phases = (("prefill_worker.kv_peer_pull", pulling_s), *phases)
        tracing.record_call(
            context.invocation_metadata(),
            "prefill_worker.prefill",
            phases,
            {
                "pdserve.prompt_tokens": len(prompt),
                "pdserve.cached_tokens": last.num_cached_tokens,
                "pdserve.host_cached_tokens": last.num_host_cached_tokens,
            },
        )
        if exported.first_token_logprobs is not None:
            response.first_token_logprobs.CopyFrom(logprobs_to_proto(exported.first_token_logprobs))
        if last.finished:
            # The first token ended the request: nothing to decode, nothing to lease.
            await self.leases.end(request_id, None)
            response.finished = finish_reason_to_proto(last.finish_reason)
            return response
        assert self._sender is not None
        handle = self._sender.handle(
            request_id,
            len(exported.block_ids),
            self.config.lease_s,
            token,
            prompt_digest(exported.prompt_token_ids),
        )
        response.lease.CopyFrom(handle_to_proto(handle))
        return response

    async def LeasePrefix(
        self, request: prefill_pb2.LeasePrefixRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.LeasePrefixResponse:
        """Pins the cached blocks of a peer's prompt prefix under a lease of its own (id and
        token made here: a caller names neither), as ``Prefill``'s are leased."""
        ids, size = list(request.prompt_token_ids), self.engine.block_size
        why = lease_prefix_refusal(request, size, self.engine.max_model_len)
        if why is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        lease_id = f"prefix-{uuid.uuid4().hex}"

        async def lend_and_lease() -> tuple[list[int], str]:
            """Leased in the same breath as pinned: a caller that leaves (however often it is
            cancelled) leaves a lease that expires, never blocks pinned without one."""
            lent = await self.engine.lend_prefix(
                lease_id, ids, request.first_block, len(ids) // size
            )
            return lent, self.leases.grant(lease_id, lent) if lent else ""

        try:
            lent, token = await asyncio.shield(asyncio.ensure_future(lend_and_lease()))
        except PeerPullUnsupported as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        metrics.PEER_LENT_BLOCKS.inc(len(lent))
        assert self._sender is not None
        return prefix_lease(self._sender, lease_id, len(lent), self.config.lease_s, token, request)

    async def GetStats(
        self, request: common_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.WorkerStats:
        return self.stats()


def _split(
    received_s: float, first_scheduled_s: float | None, done_s: float
) -> tuple[float, float]:
    """A prefill call's queueing (received -> the engine's first step with it) and compute
    (-> the first token), on time.monotonic(); all compute when the engine does not say."""
    started_s = received_s if first_scheduled_s is None else max(first_scheduled_s, received_s)
    return started_s - received_s, max(done_s - started_s, 0.0)
