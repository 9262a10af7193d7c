"""The decode worker's gRPC service.

Admission: a request is admitted only if its prompt's blocks can be allocated now
(RESOURCE_EXHAUSTED otherwise; the router retries elsewhere or waits). Who ends the prefill lease
after that is the contract in ``kvtransfer/base.py``. The request then joins the batch without
computing any prompt token (the engine counts them; the test suite asserts zero).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping

import grpc
from opentelemetry.trace import Span

from decode_service.config import DecodeConfig
from engine.outputs import PrefilledRequest, RequestUpdate
from engine.request_error import RequestIdInUse
from engine.serving_engine import EngineBuilder, EngineDeadError, NoRoomError
from kvtransfer import (
    KVHandle,
    KVReceiver,
    KVTransferError,
    ReceiverOptions,
    TransferErrorCode,
)
from kvtransfer.base import prompt_digest
from kvtransfer.prefix_pull import PrefixPuller
from kvtransfer.sharded import engine_receiver
from kvtransfer.wire import handle_from_proto
from pdserve.cluster.last_known import LastKnownWorkers
from pdserve.common import metrics, tracing
from pdserve.common.channels import ChannelPool
from pdserve.common.convert import finish_reason_to_proto, logprobs_from_proto, logprobs_to_proto
from pdserve.common.lease_release import LEASE_ENDED, LeaseReleaser
from pdserve.common.role import Role
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2
from pdserve.worker.peers import PeerDirectory
from pdserve.worker.service import WorkerService

logger = logging.getLogger(__name__)

_TRANSFER_CODES = {
    TransferErrorCode.LAYOUT_MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
    TransferErrorCode.CORRUPTED: grpc.StatusCode.DATA_LOSS,
    TransferErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    TransferErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}


class DecodeService(WorkerService, decode_pb2_grpc.DecodeWorkerServicer):
    role = Role.DECODE
    name = "pdserve.v1.DecodeWorker"

    def __init__(self, config: DecodeConfig, build_engine: EngineBuilder) -> None:
        super().__init__(
            config.engine,
            config.redis,
            config.worker_id,
            max_buffered_tokens=config.max_buffered_tokens,
            heartbeat_s=config.heartbeat_s,
            build_engine=build_engine,
        )
        self.config = config
        self._receiver: KVReceiver | None = None
        self._channels = ChannelPool(tls=config.server.tls)
        self._releaser = LeaseReleaser(self._channels, config.release_timeout_s)
        self._peers: PeerDirectory | None = None
        # A local prefill's peer pull (docs/kv-cache.md): the holders it may pull a prompt's
        # prefix from (prefill workers and KV stores), made at the first pull.
        self._holders: PeerDirectory | None = None
        self._puller: PrefixPuller | None = None

    def register(self, server: grpc.aio.Server) -> None:
        decode_pb2_grpc.add_DecodeWorkerServicer_to_server(self, server)

    async def load(self) -> None:
        await super().load()
        # In a thread: a NIXL receiver registers the whole cache with its agent. None: an
        # engine that serves colocated requests only.
        options = ReceiverOptions(
            self.config.transfer_timeout_s,
            tls=self.config.server.tls,
            verify=self.config.kv_verify,
            ucx_tls=self.config.ucx_tls,
        )
        self._receiver = await asyncio.to_thread(
            engine_receiver, self.engine, self.config.kv_backend, options
        )
        registry = self.membership.registry if self.membership is not None else None
        redis = self.config.redis
        last_known = LastKnownWorkers(redis.last_known_file if redis is not None else None)
        self._peers = PeerDirectory(
            self.config.prefill_peers, registry, self._channels, last_known, self._peers_changed
        )
        self._peers.start()

    async def _peers_changed(self, _: Mapping[str, str]) -> None:
        """Departed prefill peers (and holders): their channels retire, the receiver forgets
        their senders."""
        peers = {
            **(self._peers.known() if self._peers is not None else {}),
            **(self._holders.known() if self._holders is not None else {}),
        }
        await self._channels.retain(set(peers))
        if self._receiver is not None:
            await self._receiver.retain_peers(set(peers.values()))

    def puller(self) -> PrefixPuller:
        """The local prefill's peer puller, made at its first pull."""
        if self._puller is None:
            registry = self.membership.registry if self.membership is not None else None
            self._holders = PeerDirectory(
                self.config.prefill_peers,
                registry,
                self._channels,
                on_change=self._peers_changed,
                stores=(),
            )
            self._holders.start()
            self._puller = PrefixPuller(
                self.engine,
                self._receiver,
                self._holders.kv_sender,
                self._channels,
                self._releaser,
                self.config.transfer_timeout_s,
            )
        return self._puller

    async def close(self) -> None:
        for directory in (self._peers, self._holders):
            if directory is not None:
                await directory.stop()
        await self._releaser.close()
        if self._receiver is not None:
            await self._receiver.close()
        await self._channels.close()
        await super().close()

    async def GetStats(
        self, request: common_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.WorkerStats:
        return self.stats()

    async def Decode(
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        params = await self.accept(context, request.request_id, request.sampling)
        prefilled = PrefilledRequest(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            first_token_id=request.first_token_id,
            params=params,
            block_ids=[],
            first_token_logprobs=(
                logprobs_from_proto(request.first_token_logprobs)
                if request.HasField("first_token_logprobs")
                else None
            ),
            num_generated_tokens=request.num_generated_tokens,
        )
        if self._receiver is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this decode worker's engine takes no remote KV (it serves colocated requests "
                "only; docs/engines.md)",
            )
        try:
            handle = handle_from_proto(request.handle)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        await self._check_source(handle, request, context)
        with self.in_flight():
            start = time.perf_counter()
            caller = tracing.worker_context(context.invocation_metadata())
            holder = True  # the engine's request of this id is this call's
            try:
                with tracing.span("decode_worker.admission", caller, start) as traced:
                    admission = asyncio.ensure_future(
                        self.engine.admit_prefilled(
                            prefilled,
                            lambda block_ids: self._pull(
                                handle, block_ids, request.prefill_address, context, traced
                            ),
                        )
                    )
                    try:
                        # Heartbeats while the KV arrives: the router's stall timeout bounds
                        # silence, not the length of a legitimate pull.
                        while not (
                            await asyncio.wait({admission}, timeout=self.config.heartbeat_s)
                        )[0]:
                            yield HEARTBEAT
                    except BaseException:
                        # The pull stops and waits until it stopped writing; the engine frees.
                        admission.cancel()
                        await asyncio.gather(admission, return_exceptions=True)
                        raise
                    try:
                        transfer_s, num_blocks = admission.result()
                    except NoRoomError as exc:
                        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
                    except RequestIdInUse as exc:  # another call's request holds the id
                        holder = False
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                    except ValueError as exc:
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                    admission_s = time.perf_counter() - start
                    if traced is not None:  # the pull's span is live (in _pull); this waited
                        traced.set_attribute("pdserve.kv_blocks", num_blocks)
                        allocate_s = max(admission_s - transfer_s, 0.0)
                        tracing.record("decode_worker.allocate", traced, start, start + allocate_s)
                yield decode_pb2.DecodeResponse(
                    admitted=decode_pb2.Admitted(transfer_s=admission_s, kv_pull_s=transfer_s)
                )
                logger.info(
                    "request_id=%s admitted: %d blocks pulled in %.1f ms",
                    request.request_id,
                    num_blocks,
                    transfer_s * 1e3,
                )
                stream = self.engine.stream_prefilled(prefilled)
                first = True
                async with contextlib.aclosing(stream) as updates:
                    async for update in updates:
                        skip = 1 if first else 0  # the router has the prefill worker's token
                        first = first and not update.new_token_ids
                        for event in events_of(update, skip):
                            yield event
            except ValueError as exc:  # the request's own failure (engine/request_error.py)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except EngineDeadError as exc:
                await self.abort_engine_dead(context, exc)
            finally:
                # However this ends (finished, failed pull, client gone at any await), the
                # request's blocks go back; a no-op when it already finished.
                if holder:
                    with contextlib.suppress(EngineDeadError):
                        await self.engine.abort(prefilled.request_id)

    async def PrefillAndDecode(
        self, request: decode_pb2.PrefillAndDecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        params = await self.accept(context, request.request_id, request.sampling)
        await self.check_fingerprint(context, request.model_fingerprint)
        prompt = list(request.prompt_token_ids)
        await self.check_fits(context, len(prompt))
        self.inject_faults(request.request_id, prompt)
        # A pull saves prompt compute; prompt logprobs need every position computed here.
        source = request.prefix if request.HasField("prefix") else None
        if params.prompt_logprobs is not None:
            source = None
        with self.in_flight():
            # Queued: the scheduler takes it like any other.
            yield decode_pb2.DecodeResponse(queued=decode_pb2.Queued())
            try:
                pulls = self.puller() if source is not None else None
                async with _pulled(pulls, request.request_id, prompt, source):
                    stream = self.engine.generate(
                        request.request_id,
                        prompt,
                        params,
                        num_generated_tokens=request.num_generated_tokens,
                    )
                    async with contextlib.aclosing(stream) as updates:
                        async for update in updates:
                            for event in events_of(update, 0):
                                yield event
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except EngineDeadError as exc:
                await self.abort_engine_dead(context, exc)

    async def _check_source(
        self,
        handle: KVHandle,
        request: decode_pb2.DecodeRequest,
        context: grpc.aio.ServicerContext,
    ) -> None:
        """KV only from a known prefill worker's own sender, and only for the prompt it was
        computed for; refused before anything is reserved (see ``pdserve/worker/peers.py``)."""
        assert self._peers is not None
        why = await self._peers.refusal(request.prefill_address, handle.address)
        if why is None and handle.prompt_digest != prompt_digest(list(request.prompt_token_ids)):
            why = "handle.prompt_digest does not match prompt_token_ids"
        if why is not None:
            logger.warning("request_id=%s refused: %s", request.request_id[:64], why)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)

    async def _pull(
        self,
        handle: KVHandle,
        block_ids: list[int],
        prefill_address: str,
        context: grpc.aio.ServicerContext,
        traced: Span | None,
    ) -> tuple[float, int]:
        """Pulls the KV into the blocks the engine allocated (its ``fill``: the engine frees
        them on failure). Success or not, then asks the prefill worker to release its lease.
        Returns the pull's duration and block count. ``traced``: the admission's span (the
        pull's span goes under it, and the sender's under that)."""
        assert self._receiver is not None
        with tracing.span("decode_worker.kv_pull", traced) as span:
            trace = tracing.metadata(span)
            pull = asyncio.ensure_future(self._receiver.pull(handle, block_ids, trace))
            try:
                stats = await asyncio.shield(pull)
            except asyncio.CancelledError:
                # Stop the pull and wait until it stopped writing: the caller frees the blocks.
                pull.cancel()
                await asyncio.wait([pull])
                raise
            except KVTransferError as exc:
                metrics.TRANSFER_FAILURES.labels(exc.code.value).inc()
                logger.warning("request_id=%s KV pull failed: %s", handle.request_id, exc)
                context.set_trailing_metadata((LEASE_ENDED,))  # ended in the finally below
                await context.abort(_TRANSFER_CODES[exc.code], f"KV transfer failed: {exc}")
            except ValueError as exc:  # a handle that does not fit the request
                context.set_trailing_metadata((LEASE_ENDED,))
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            finally:
                self._releaser.release_later(prefill_address, handle.request_id, handle.lease_token)
        metrics.TRANSFER_BYTES.labels("received").inc(stats.num_bytes)
        metrics.TRANSFER_S.observe(stats.duration_s)
        return stats.duration_s, len(block_ids)


HEARTBEAT = decode_pb2.DecodeResponse(heartbeat=decode_pb2.Heartbeat())


def events_of(update: RequestUpdate, skip: int) -> list[decode_pb2.DecodeResponse]:
    """An engine update as stream events: its tokens (but the first ``skip``), then its finish;
    an update with neither is a heartbeat. Its prompt's logprobs and cache hits go with its
    tokens (a Decode's have none: its prompt was prefilled elsewhere)."""
    events = []
    token_ids, logprobs = update.new_token_ids[skip:], update.new_logprobs[skip:]
    if token_ids:
        tokens = decode_pb2.Tokens(
            token_ids=token_ids,
            logprobs=[logprobs_to_proto(lp) for lp in logprobs],
            prompt_logprobs=[logprobs_to_proto(lp) for lp in update.prompt_logprobs],
            num_cached_tokens=update.num_cached_tokens,
            num_host_cached_tokens=update.num_host_cached_tokens,
        )
        events.append(decode_pb2.DecodeResponse(tokens=tokens))
    if update.finished:
        finished = decode_pb2.Finished(
            reason=finish_reason_to_proto(update.finish_reason),
            num_spec_proposed_tokens=update.num_spec_proposed_tokens,
            num_spec_accepted_tokens=update.num_spec_accepted_tokens,
        )
        events.append(decode_pb2.DecodeResponse(finished=finished))
    return events or [HEARTBEAT]


@contextlib.asynccontextmanager
async def _pulled(
    puller: PrefixPuller | None,
    request_id: str,
    prompt: list[int],
    source: prefill_pb2.PrefixSource | None,
) -> AsyncIterator[None]:
    """``PrefixPuller.pulled`` when there is a source to pull from; else nothing."""
    if puller is None or source is None:
        yield
        return
    async with puller.pulled(request_id, prompt, source):
        yield
