"""The engine loop: admit requests, schedule a step, run it, turn samples into updates.

``LLMEngine`` owns scheduling and request state; the model, its KV cache and the runner belong to
the ``LoadedModel`` it holds. Disaggregation hooks (who calls them, and who frees which block
when, is the contract in ``kvtransfer/base.py``; here is only what each hook does):
- ``add_request(..., prefill_only=True)``: the request stops after its first token; its blocks
  stay pinned (still referenced) and it is listed in ``pinned``. ``export_prefilled`` names them;
  the KV sender reads them through ``kv_cache``; ``free_pinned`` frees them, exactly once.
- ``reserve_prefilled``: allocates blocks for a prompt computed elsewhere, or returns None if
  there is no room; the KV receiver writes them through ``kv_cache``; ``start_prefilled`` joins
  the request to the batch (it computes no prompt token); ``abort`` frees them at any point.
"""

from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import Future

from engine.block_hash import BlockHash
from engine.config import EngineConfig
from engine.guide import Guide
from engine.kv_events import CacheTier, KVEventLog
from engine.outputs import EngineStats, PrefilledRequest, RequestUpdate
from engine.request_error import RequestError, RequestIdInUse
from engine.request_state import RequestState
from engine.sampling_params import SamplingParams
from engine.sequence import SequenceStatus, TokenLogprobs
from native_engine.block_manager import BlockManager
from native_engine.host_loads import HostLoads
from native_engine.host_tier import make_host_tier
from native_engine.loaded_model import LoadedModel
from native_engine.model_runner import SeqSamples
from native_engine.paged_sequence import PagedSequence
from native_engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from native_engine.speculator import draft_block_bytes, make_speculator

logger = logging.getLogger(__name__)


class LLMEngine:
    """Single-process engine. Not thread-safe: one caller drives ``step``."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.loaded = LoadedModel(config, draft_block_bytes(config))
        loaded = self.loaded
        # Fixed once loaded; read by the loop and by the services through AsyncEngine.
        self.model_config, self.tokenizer = loaded.model_config, loaded.tokenizer
        self.max_model_len, self.block_size = loaded.max_model_len, loaded.block_size
        self.num_blocks, self.fingerprint = loaded.num_blocks, loaded.fingerprint
        self.kv_cache, self.kv_layout = loaded.kv_cache, loaded.kv_layout
        self.runner = loaded.runner
        self.intake = loaded.intake
        self.host_tier = tier = make_host_tier(config.cache, self.kv_cache)
        prefix_caching = self.config.cache.enable_prefix_caching
        host_index = tier.index if tier is not None else None
        self.block_manager = BlockManager(
            self.num_blocks, self.block_size, prefix_caching, host_index
        )
        # Nothing to run but a host-tier copy in flight: offline, the step waits for it; an
        # async driver sets this False and awaits the copy itself (``take_copy_wait``),
        # outside its lock.
        self.wait_for_copies_in_step = True
        self.copy_wait: Future[None] | None = None
        self.scheduler = Scheduler(self.config.scheduler, self.block_manager)
        self.host_loads = HostLoads(tier, self.block_manager, self.scheduler) if tier else None
        self.speculator = make_speculator(
            config, self.block_manager, self.model_config.vocab_size, self.max_model_len
        )
        self._requests: dict[str, RequestState[PagedSequence]] = {}
        self.pinned: dict[str, PagedSequence] = {}
        self._reserved: dict[str, RequestState[PagedSequence]] = {}
        self._ids = itertools.count()
        self.num_prompt_tokens_computed = 0
        self.num_prefix_hit_tokens = 0
        self.num_host_hit_tokens = 0
        self.num_steps = 0  # steps that ran the model
        # True when the last step found nothing it could run (e.g. no free blocks for waiting
        # requests); stepping again changes nothing until a request is added, freed or aborted.
        self.last_step_idle = False
        # The requests the step in progress computes for, once scheduled (None before): if
        # the step raises, the engine's last words on which requests were in it.
        self.stepping: frozenset[str] | None = None

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        prefill_only: bool = False,
        num_generated_tokens: int = 0,
        guide: Guide | None = None,
    ) -> str:
        """``num_generated_tokens``: the last that many tokens of ``prompt`` are output a
        previous engine already produced (a migrated request): they count toward
        ``max_tokens``, the seeded sampler's output index and stop strings, exactly as if this
        engine had generated them; the client's prompt is the rest. ``guide``: a guided
        request's matcher, made off the event loop (``Intake.prepare_guide``); else here."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        self.check_new_request(request_id)
        seq = self.intake.sequence(
            PagedSequence, request_id, prompt, params, num_generated_tokens, guide=guide
        )
        seq.prefill_only = prefill_only
        seq.wants_prompt_logprobs = params.prompt_logprobs is not None and not num_generated_tokens
        self._hash(seq)
        self._requests[request_id] = self._state(seq)
        self.scheduler.add(seq)
        return request_id

    def check_new_request(self, request_id: str) -> None:
        """One namespace for ids at every stage."""
        if any(request_id in table for table in (self._requests, self.pinned, self._reserved)):
            raise RequestIdInUse.of(request_id)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks. False if unknown."""
        if request_id in self.pinned:
            self.free_pinned(request_id)
            return True
        req = self._requests.pop(request_id, None) or self._reserved.pop(request_id, None)
        if req is None:
            return False
        req.seq.status = SequenceStatus.FINISHED_ABORTED
        self.scheduler.remove(req.seq)
        # A copy may still write its blocks: then they are freed once it lands.
        if self.host_loads is None or not self.host_loads.abandon(request_id):
            self.block_manager.free(req.seq)
        if self.speculator is not None:
            self.speculator.release(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests or (self.host_loads and self.host_loads.abandoned))

    def pause(self, request_id: str) -> bool:
        """Its consumer stopped reading: the request keeps its blocks but stops being scheduled
        and gives up its seat. False when it holds no seat (waiting) or is gone."""
        req = self._requests.get(request_id)
        return req is not None and self.scheduler.pause(req.seq, time.monotonic())

    def resume(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is not None:
            self.scheduler.resume(req.seq)

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestUpdate]:
        """One iteration: schedule, run, postprocess. The host tier and speculation take part
        through the hooks around it (``_before_schedule``, ``_runnable``, ``_widen``,
        ``_after_step``), never as branches here."""
        self.stepping = None
        self._before_schedule()
        out = self.scheduler.schedule(time.monotonic())
        updates = [self._finish(self._requests[s.request_id], s.status) for s in out.dropped]
        if not self._runnable(out, bool(updates)):
            return updates
        scheduled = self._widen(out)
        self.stepping = frozenset(s.seq.request_id for s in scheduled)
        results = self.runner.execute(scheduled)
        self.num_steps += 1
        updates += self._postprocess(scheduled, results)
        self._after_step()
        return updates

    def _before_schedule(self) -> None:
        """Host tier: requests whose blocks came back from host memory take their seats."""
        if self.host_loads is not None:
            self.host_loads.finish()

    def _runnable(self, out: SchedulerOutput, finished_some: bool) -> bool:
        """Host tier: starts the copies the schedule asked for. Whether there is a batch to
        run; without one, the step is idle, or a copy in flight gates the next."""
        pending: list[Future[None]] = []
        if self.host_loads is not None:
            self.host_loads.start(out.loads)
            pending = self.host_loads.pending()
        self.last_step_idle = out.is_empty and not finished_some and not pending
        if not out.is_empty:
            return True
        if pending and not finished_some:  # nothing to run until a copy lands
            if self.wait_for_copies_in_step:
                pending[0].result()
            else:
                self.copy_wait = pending[0]
        return False

    def _widen(self, out: SchedulerOutput) -> list[ScheduledSeq]:
        """Speculation: guesses to verify join the batch, within the step's token budget. Host
        tier: copies into blocks handed out again finish before anything overwrites them."""
        scheduled = out.scheduled
        if self.speculator is not None:
            budget = self.config.scheduler.max_num_batched_tokens - out.num_batched_tokens
            scheduled = self.speculator.plan(scheduled, budget)
        self.sync_host_tier()
        return scheduled

    def _postprocess(
        self, scheduled: list[ScheduledSeq], results: list[SeqSamples]
    ) -> list[RequestUpdate]:
        """Commits what the step computed, then turns its samples into updates."""
        accepted: dict[int, int] = {}  # guesses kept, per verified sequence
        if (spec := self.speculator) is not None:
            accepted = {
                id(r.scheduled): spec.accept(r) for r in results if r.scheduled.spec_token_ids
            }
        for s in scheduled:
            seq = s.seq
            self.num_prompt_tokens_computed += seq.num_prompt_tokens_in(s.num_new_tokens)
            if s.spec_token_ids:
                # Only the last token and the accepted guesses are in the cache for good;
                # the rejected guesses' slots go back (their KV is never read).
                seq.num_computed_tokens += 1 + accepted[id(s)]
                self.block_manager.trim(seq, seq.num_computed_tokens)
            else:
                seq.num_computed_tokens += s.num_new_tokens
            self.block_manager.register_computed_blocks(seq)
        updates: list[RequestUpdate] = []
        for r in results:
            seq, n = r.scheduled.seq, 1 + accepted.get(id(r.scheduled), 0)
            num_output_tokens = seq.num_output_tokens
            tokens = list(zip(r.token_ids[:n], r.logprobs[:n], strict=True))
            req = self._requests[seq.request_id]
            try:
                update = self._append_tokens(req, tokens)
            except RequestError as exc:  # the request's own failure: the batch goes on
                updates.append(self._fail(req, str(exc)))
                continue
            if update is not None:
                updates.append(update)
            if spec is not None and r.scheduled.spec_token_ids:  # what it output, less its own
                spec.record(r.scheduled, seq.num_output_tokens - num_output_tokens - 1)
        return updates

    def _after_step(self) -> None:
        """Host tier: finished requests' blocks head for it now."""
        if self.host_loads is not None:
            self.host_loads.store_freed()

    # ---- what an async driver (native_engine/async_engine.py) calls between steps -----------
    def take_copy_wait(self) -> Future[None] | None:
        """The copy the next step waits for, once (None: none)."""
        copy, self.copy_wait = self.copy_wait, None
        return copy

    def kv_event_logs(self) -> list[tuple[KVEventLog, CacheTier]]:
        """The logs of blocks cached and evicted, per tier, for the prefix index."""
        logs = [(self.block_manager.kv_events, CacheTier.DEVICE)]
        if self.host_tier is not None:
            logs.append((self.host_tier.index.kv_events, CacheTier.HOST))
        return logs

    def cached_hashes(self) -> dict[CacheTier, list[BlockHash]]:
        """Every cached block hash, per tier."""
        hashes = {CacheTier.DEVICE: self.block_manager.cached_hashes()}
        if self.host_tier is not None:
            hashes[CacheTier.HOST] = self.host_tier.index.hashes()
        return hashes

    def sync_host_tier(self) -> None:
        """Before freshly handed-out blocks are written: their host-tier copies finish."""
        if self.host_loads is not None:
            self.host_loads.sync()

    def _append_tokens(
        self, req: RequestState[PagedSequence], tokens: list[tuple[int, TokenLogprobs | None]]
    ) -> RequestUpdate | None:
        """Appends one step's tokens (several when guesses were accepted), stopping at the
        first that ends the request exactly as if they had come one step at a time."""
        seq = req.seq
        if not req.reported_cached:
            self.num_prefix_hit_tokens += max(seq.num_cached_tokens, 0)
            self.num_host_hit_tokens += seq.num_host_cached_tokens
        for token_id, logprobs in tokens:
            status = req.append(
                token_id, logprobs, self.model_config.eos_token_ids, self.max_model_len
            )
            self._hash(seq)
            if status is not None:
                return self._finish(req, status)
        if seq.prefill_only:
            return self._pin(req)
        return req.flush(None)

    def _fail(self, req: RequestState[PagedSequence], message: str) -> RequestUpdate:
        """Ends a request its own parameters failed (a ``RequestError`` from its tokens); its
        blocks go back."""
        return self._finish(req, req.fail(message))

    def _finish(self, req: RequestState[PagedSequence], status: SequenceStatus) -> RequestUpdate:
        seq = req.seq
        status = req.finish(status)
        self.scheduler.remove(seq)
        del self._requests[seq.request_id]
        if self.speculator is not None:
            self.speculator.release(seq.request_id)
        # Finished at its first token: the caller still owns a free_pinned() of the blocks.
        failed = status is SequenceStatus.FINISHED_ERROR
        pinned = seq.prefill_only and seq.num_output_tokens > 0 and not failed
        if pinned:
            self.pinned[seq.request_id] = seq
        else:
            self.block_manager.free(seq)
        return req.flush(status.finish_reason, prefilled=pinned)

    def _pin(self, req: RequestState[PagedSequence]) -> RequestUpdate:
        seq = req.seq
        self.scheduler.remove(seq)
        del self._requests[seq.request_id]
        self.pinned[seq.request_id] = seq
        return req.flush(None, prefilled=True)

    def _state(self, seq: PagedSequence) -> RequestState[PagedSequence]:
        return RequestState.create(seq, self.tokenizer, self.model_config.eos_token_ids)

    def _hash(self, seq: PagedSequence) -> None:
        if self.config.cache.enable_prefix_caching:
            seq.update_block_hashes(self.loaded.root_hash, self.block_size)

    # ---- disaggregation: prefill side ------------------------------------------------------
    def export_prefilled(self, request_id: str) -> PrefilledRequest:
        seq = self.pinned[request_id]
        return PrefilledRequest.of_pinned(seq, list(seq.block_table))

    def free_pinned(self, request_id: str) -> None:
        """Free a pinned request's blocks. Raises KeyError if not pinned (a second free)."""
        seq = self.pinned.pop(request_id)
        self.block_manager.free(seq)
        if self.host_loads is not None:  # a prefill worker's blocks reach the tier at once
            self.host_loads.store_freed()

    # ---- disaggregation: decode side -------------------------------------------------------
    def reserve_prefilled(
        self, request: PrefilledRequest, guide: Guide | None = None
    ) -> list[int] | None:
        """Allocate blocks for a request prefilled elsewhere; None when the cache is too full.
        ``guide``: as in ``add_request``, past the output before the first token."""
        self.check_new_request(request.request_id)
        self.intake.validate_token_ids([request.first_token_id], "first_token_id")
        seq = self.intake.sequence(
            PagedSequence,
            request.request_id,
            request.prompt_token_ids,
            request.params,
            request.num_generated_tokens,
            guide=guide,
        )
        if not self.block_manager.allocate_slots(seq, seq.num_tokens):
            return None
        try:
            self.sync_host_tier()  # the KV receiver writes these blocks from its own thread
        except BaseException:
            self.block_manager.free(seq)
            raise
        seq.num_cached_tokens = 0
        self._reserved[request.request_id] = self._state(seq)
        return list(seq.block_table)

    def start_prefilled(self, request: PrefilledRequest) -> RequestUpdate | None:
        """The KV is written: the request joins the batch as if it had prefilled here.

        Returns an update carrying the first token (already final if it ended the request).
        """
        req = self._reserved.pop(request.request_id)
        seq = req.seq
        seq.num_computed_tokens = seq.num_tokens
        self._hash(seq)
        self.block_manager.register_computed_blocks(seq)
        self._requests[seq.request_id] = req
        self.scheduler.add_ready(seq)  # it takes a decode seat when one is free
        first = [(request.first_token_id, request.first_token_logprobs)]
        try:
            return self._append_tokens(req, first)
        except RequestError as exc:  # not a token its parameters allow here
            return self._fail(req, str(exc))

    # ---- validation and introspection ------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return self.block_manager.blocks_needed(num_tokens)

    def stats(self) -> EngineStats:
        """Each component reports its own counters; the engine adds its request counts."""
        return EngineStats(
            **self.scheduler.stats_fields(),
            **self.block_manager.stats_fields(),
            num_pinned=len(self.pinned),
            num_prompt_tokens_computed=self.num_prompt_tokens_computed,
            num_prefix_hit_tokens=self.num_prefix_hit_tokens,
            num_steps=self.num_steps,
            num_host_hit_tokens=self.num_host_hit_tokens,
            **(self.host_tier.stats_fields() if self.host_tier else {}),
            **(self.speculator.stats_fields() if self.speculator else {}),
        )
