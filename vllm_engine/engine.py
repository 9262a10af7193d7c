"""The vLLM engine behind pdserve's serving contract (``engine/serving_engine.py``).

vLLM's engine core runs in this process or in one of its own (``engine.config.VllmEngineCore``;
a ``CoreDriver`` drives it, ``vllm_engine/core_driver.py``); its ranks, when they run in
processes of their own, each move their own shard of the KV (``vllm_engine/rank_transfer.py``),
and the connector's bookkeeping of each request's blocks is the ``Bridge``
(``vllm_engine/bridge.py``).

vLLM computes and samples (greedily over what pdserve's sampler decided); pdserve keeps each
request's text, stop conditions and lengths (``engine.request_state``), so a request ends on
every engine, and on every path, where the native engine ends it. A request whose reader is
slow is paused at ``max_buffered_tokens`` waiting, as on the native engine: it leaves vLLM
(seat and blocks) until its reader takes half, then goes on as a continuation
(``vllm_engine/request_table.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import grpc
from vllm.outputs import RequestOutput

from engine.block_hash import BlockHash
from engine.checkpoint import CheckpointInfo
from engine.config import EngineConfig
from engine.fault_injection import FaultInjection
from engine.guide import Guide, GuideCompiler
from engine.kv_events import CacheTier, KVEvents
from engine.kv_layout import KVCacheLayout
from engine.outputs import EngineStats, PrefilledRequest, RequestUpdate
from engine.sampling_params import SamplingParams
from engine.serving_engine import (
    EngineDeadError,
    EngineHooks,
    FaultEvidence,
    NoRoomError,
    ServingEngine,
    raise_on_error,
)
from engine.step_progress import StepProgress
from engine.tokenizer import Tokenizer
from kvtransfer import ReceiverOptions, SenderOptions, make_sender
from kvtransfer.base import BlockLeases, KVReceiver, KVSender
from kvtransfer.shard_receiver import ShardReceiver
from kvtransfer.sharded import ShardedKV
from vllm_engine.bridge import Bridge
from vllm_engine.core_driver import CoreCallbacks, CoreDriver, refusal
from vllm_engine.events import CachedBlocks
from vllm_engine.kv_pages import VllmKVPages
from vllm_engine.rank_hub import RankHub
from vllm_engine.rank_transfer import RankKVReceiver, RankKVSender
from vllm_engine.request import Mode, Request
from vllm_engine.request_table import RequestTable

logger = logging.getLogger(__name__)
T = TypeVar("T")
# How long an admitted request may wait for vLLM's scheduler to allocate its blocks (it checked
# there was room; others may take it first): then RESOURCE_EXHAUSTED, and the router retries.
ALLOCATION_TIMEOUT_S = 10.0


class VllmEngine(ServingEngine, ShardedKV):
    def __init__(
        self,
        core: CoreDriver,
        bridge: Bridge,
        hub: RankHub | None,
        config: EngineConfig,
        hooks: EngineHooks,
        *,
        checkpoint: CheckpointInfo,
        tokenizer: Tokenizer | None,
        fingerprint: str,
        max_model_len: int,
        vocab_size: int,
        cached: CachedBlocks,
    ) -> None:
        self._core, self._bridge, self._config, self._hooks = core, bridge, config, hooks
        self._hub = hub
        # None when the ranks run in processes of their own: the pages are theirs.
        self._pages: VllmKVPages | None = bridge.kv_pages
        if self._pages is not None:
            self._layout = self._pages.layout
        elif hub is not None:
            self._layout = hub.layout  # every rank said hello while vLLM built it
        else:
            raise RuntimeError("vLLM registered no KV cache with pdserve's connector")
        self._guides = GuideCompiler.shared(
            Path(config.model), vocab_size, checkpoint.eos_token_ids
        )
        self._guides.warm()  # built in the loading thread: it holds the GIL (~0.3 s)
        self._table = RequestTable(
            core,
            bridge,
            checkpoint,
            tokenizer,
            max_model_len,
            self._guides,
            hooks.max_buffered_tokens,
        )
        self._fingerprint, self._max_model_len = fingerprint, max_model_len
        self._cached = cached
        if hub is not None:
            hub.on_pinned = self._pin_arrived
        self.error: BaseException | None = None
        self.progress: StepProgress = core.progress  # the driver's loop writes it
        self.collect_kv_events = False
        self._kv_events: list[KVEvents] = []
        self.stats = self._stats()
        self._faults = FaultInjection(raise_on_token=config.fault_raise_on_token)  # tests only
        # The request whose output is being delivered: a failure there is that request's
        # (the engine's last words name it alone).
        self._delivering: str | None = None

    # ---- what the model and cache are ------------------------------------------------------
    @property
    def kv_layout(self) -> KVCacheLayout:
        return self._layout

    @property
    def kv_pages(self) -> VllmKVPages | None:
        return self._pages

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    # ---- ShardedKV: senders and receivers that map tensor-parallel shards ----------------------
    def make_kv_sender(self, backend: str, leases: BlockLeases, options: SenderOptions) -> KVSender:
        if self._hub is not None:
            return RankKVSender(self._hub, backend, leases, options)
        assert self._pages is not None
        return make_sender(backend, self._pages, leases, options)

    def make_kv_receiver(self, backend: str, options: ReceiverOptions) -> KVReceiver:
        if self._hub is not None:
            return RankKVReceiver(self._hub, backend, options)
        assert self._pages is not None
        return ShardReceiver(backend, self._pages, options)

    @property
    def block_size(self) -> int:
        return self._layout.block_size

    @property
    def num_blocks(self) -> int:
        return self._core.num_blocks

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_buffered_tokens(self) -> int:
        return sum(r.out.num_buffered_tokens for r in self._table.requests.values())

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self._core.start(CoreCallbacks(self._deliver, self._refresh, self._refuse, self._die))

    async def close(self) -> None:
        await self._core.close()
        self._bridge.close()
        if self._hub is not None:
            await self._hub.close()

    # ---- requests ---------------------------------------------------------------------------
    def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        prefill_only: bool = False,
        num_generated_tokens: int = 0,
    ) -> AsyncGenerator[RequestUpdate, None]:
        mode = Mode.PREFILL if prefill_only else Mode.GENERATE

        def admit(guide: Guide | None) -> Request:
            return self._table.add(
                request_id, prompt_ids, params, mode, num_generated_tokens, guide
            )

        earlier = prompt_ids[len(prompt_ids) - num_generated_tokens :]
        self._faults.admitted(request_id, prompt_ids)
        return self._stream(request_id, admit, params, earlier)

    def export_prefilled(self, request_id: str) -> PrefilledRequest:
        return self._table.export(request_id)

    async def free_pinned(self, request_id: str) -> None:
        await asyncio.shield(self._call(lambda: self._table.release(request_id)))

    async def admit_prefilled(
        self, request: PrefilledRequest, fill: Callable[[list[int]], Awaitable[T]]
    ) -> T:
        rid = request.request_id
        ids, num_generated = request.prompt_token_ids, request.num_generated_tokens
        self._faults.admitted(rid, ids)
        guide = await self._prepare_guide(request.params, ids[len(ids) - num_generated :])
        needed = self.blocks_for(len(request.prompt_token_ids))
        req, allocation = await self._call(
            lambda: self._table.add_remote(
                request, needed, self._core.num_free_blocks(), self.num_blocks, guide
            )
        )

        def ours() -> bool:  # still this add (not aborted; the id not added again since)
            return self._table.requests.get(rid) is req

        try:
            try:
                block_ids = await asyncio.wait_for(allocation, ALLOCATION_TIMEOUT_S)
            except TimeoutError:  # others took the blocks first
                raise NoRoomError.of(self.stats.num_free_blocks, self.num_blocks, needed) from None
            if not ours():
                raise EngineDeadError(f"request {rid!r} was aborted while blocks were allocated")
            req.filling = True
            result = await fill(block_ids)
        except BaseException:
            # fill has stopped writing (its contract): vLLM frees the blocks at its next step.
            req.filling = False
            self._bridge.load_finished(rid, req.attempt, ok=False)
            if ours():
                await self.abort(rid)
            raise
        req.filling = False
        self._bridge.load_finished(rid, req.attempt, ok=True)
        if ours() and req.done:  # its first token ended it: vLLM frees the blocks it just got
            await self._call(lambda: self._core.abort([rid]))
        return result

    def stream_prefilled(self, request: PrefilledRequest) -> AsyncGenerator[RequestUpdate, None]:
        # Admitted: its first update (the first token) is already queued.
        return self._stream(request.request_id, None)

    async def abort(self, request_id: str) -> None:
        await asyncio.shield(self._call(lambda: self._table.abort(request_id)))

    # ---- the prefix index's view ------------------------------------------------------------
    def take_kv_events(self) -> list[KVEvents]:
        events, self._kv_events = self._kv_events, []
        return events

    async def snapshot_cached_hashes(self) -> dict[CacheTier, list[BlockHash]]:
        def snapshot() -> dict[CacheTier, list[BlockHash]]:
            self._cached.apply(self._core.take_event_batches())
            self._cached.drain()
            self._kv_events = []
            return {CacheTier.DEVICE: self._cached.hashes()}

        return await self._call(snapshot)

    # ---- calls between steps ----------------------------------------------------------------
    async def _call(self, fn: Callable[[], T]) -> T:
        self._check_alive()

        def checked() -> T:
            self._check_alive()
            return fn()

        return await self._core.call(checked)

    # ---- streams ----------------------------------------------------------------------------
    async def _prepare_guide(self, params: SamplingParams, earlier: list[int]) -> Guide | None:
        """A guided request's matcher (``GuideCompiler.guide_for``: compiled, replayed past
        ``earlier``, its first position checked) in a worker thread before admission; and the
        grammar compiled in every rank process, so that no rank compiles it in a step."""
        if params.structured is None:
            return None
        guide = await asyncio.to_thread(self._guides.guide_for, params, earlier)
        if self._hub is not None:  # the ranks sample in processes of their own
            try:
                await self._hub.compile(params.structured)
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.UNAVAILABLE:  # a rank is gone: so is vLLM
                    self._die(exc)
                    self._check_alive()
                # Slow or refused there: a rank's sampler compiles what it lacks in its step.
                logger.warning("ranks did not compile %s ahead: %s", params.structured.field, exc)
        return guide

    async def _stream(
        self,
        rid: str,
        admit: Callable[[Guide | None], Request] | None,
        params: SamplingParams | None = None,
        earlier: list[int] | None = None,
    ) -> AsyncGenerator[RequestUpdate, None]:
        if admit is not None:
            assert params is not None
            guide = await self._prepare_guide(params, earlier or [])
            await self._call(lambda: admit(guide))
        req = self._table.requests.get(rid)
        if req is None:
            raise EngineDeadError(f"request {rid!r} is gone")
        done = False
        try:
            while not done:
                update = await self._next(req)
                done = update.finished or update.prefilled
                yield raise_on_error(update)
        finally:
            self._faults.ended(rid)
            if done:
                self._table.requests.pop(rid, None)
            elif self.error is None:
                await self.abort(rid)

    async def _next(self, req: Request) -> RequestUpdate:
        rid = req.state.seq.request_id
        item = await req.out.take(rid, self._hooks.heartbeat_s)
        if req.out.wants_resume(self._table.max_buffered_tokens):
            await self._call(lambda: self._table.resume(rid))
        return item

    # ---- what the core driver tells ---------------------------------------------------------
    def _die(self, exc: BaseException) -> None:
        """Every stream and the worker are told at once. A failure delivering one request's
        output is that request's: the last words name it alone (the others are bystanders);
        a step's failure, no one."""
        logger.error("vLLM failed; failing every request", exc_info=exc)
        self.error = exc
        delivering = self._delivering
        stepping = frozenset({delivering}) if delivering is not None else None
        for rid, req in self._table.requests.items():
            req.out.fail(EngineDeadError.of_step(exc, rid, stepping))
        if self._hooks.on_dead is not None:
            self._hooks.on_dead(exc)

    def _pin_arrived(self, rid: str, attempt: int) -> None:
        """The engine core (in a process of its own) pinned the blocks of ``rid``'s add number
        ``attempt``: a held output is delivered now, under the delivery's rule (a failure
        kills the engine)."""
        self._delivering = rid
        try:
            self._table.pin_arrived(rid, attempt)
        except Exception as exc:
            self._die(exc)
            return
        finally:
            self._delivering = None
        self._refresh()  # its pin counts in the stats now

    def _refuse(self, rid: str, exc: Exception) -> None:
        """vLLM refused to add ``rid`` (its input checks): that request fails by name, as a
        request's own error (INVALID_ARGUMENT); the engine goes on."""
        error = refusal(rid, exc)
        self._bridge.refuse(rid, error)
        if (req := self._table.requests.get(rid)) is not None:
            req.out.fail(error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self._delivering = output.request_id
            self._faults.check(output.request_id)
            self._table.deliver(output)
        self._delivering = None

    def _refresh(self) -> None:
        self._cached.apply(self._core.take_event_batches())
        events = self._cached.drain()
        if self.collect_kv_events and not events.empty:
            self._kv_events.append(events)
        self.stats = self._stats()
        if self._hooks.on_stats is not None:
            self._hooks.on_stats(self.stats)

    def _stats(self) -> EngineStats:
        running, waiting = self._core.counts()
        free, cached = self._core.num_free_blocks(), len(self._cached.hashes())
        return self._table.stats(running, waiting, (self.num_blocks, free, cached), self.progress)

    def _check_alive(self) -> None:
        """A call after the engine died: the request it is for was in no step of it."""
        if self.error is not None:
            evidence = FaultEvidence.BYSTANDER
            raise EngineDeadError(f"engine step failed: {self.error!r}", evidence)
