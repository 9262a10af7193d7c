"""Every request of one vLLM engine, on pdserve's side: its vLLM request, its output state
(``engine.request_state``: text, stops, lengths), its queue to the consumer, and its pinned
blocks once prefilled. Called by ``VllmEngine`` on the event loop, through its core driver's
``call`` (``vllm_engine/core_driver.py``: between steps, when vLLM steps in this process), so it
may add and abort.

A slow reader is bounded as on the native engine: once ``max_buffered_tokens`` of a
request's output wait in its queue, the request is paused. vLLM has no pause, so it leaves
vLLM (its seat and blocks go back; full blocks stay in vLLM's prefix cache) and pdserve keeps
its state; when its reader has taken half, it is added again as a continuation of its output
so far (``resume``): the output index, penalties and grammar go on from there, as after a
migration, and it is recomputed as the native engine recomputes a paused request that gave its
blocks back.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from typing import Any

from vllm.outputs import RequestOutput

from engine.checkpoint import CheckpointInfo
from engine.guide import Guide, GuideCompiler
from engine.intake import Intake
from engine.outputs import EngineStats, PrefilledRequest, RequestUpdate
from engine.request_error import RequestError, RequestIdInUse
from engine.request_state import RequestState
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceStatus
from engine.serving_engine import NoRoomError
from engine.step_progress import StepProgress
from engine.tokenizer import Tokenizer
from vllm_engine.bridge import Bridge
from vllm_engine.core_driver import CoreDriver
from vllm_engine.request import PINNED_KEY, Mode, Request, positions, token_logprobs, vllm_params

logger = logging.getLogger(__name__)


class RequestTable:
    def __init__(
        self,
        core: CoreDriver,
        bridge: Bridge,
        checkpoint: CheckpointInfo,
        tokenizer: Tokenizer | None,
        max_model_len: int,
        guides: GuideCompiler,
        max_buffered_tokens: int,
    ) -> None:
        self._core, self._bridge = core, bridge
        self.max_buffered_tokens = max_buffered_tokens
        self._checkpoint, self._tokenizer = checkpoint, tokenizer
        self._max_model_len = max_model_len
        self._intake = Intake(
            checkpoint.vocab_size, checkpoint.eos_token_ids, max_model_len, tokenizer, guides
        )
        self.requests: dict[str, Request] = {}
        self.pinned: dict[str, Sequence] = {}
        # Each add to vLLM is numbered: a request id may be added again (a retry, a resume),
        # and the engine core's late messages of an earlier add must not be taken for it.
        self._attempts = itertools.count(1)
        self.num_prompt_tokens_computed = 0
        self.num_prefix_hit_tokens = 0

    def add(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        mode: Mode,
        num_generated: int,
        guide: Guide | None = None,
    ) -> Request:
        """``guide``: a guided request's matcher, made off the event loop
        (``GuideCompiler.guide_for``)."""
        seq = self._sequence(rid, prompt_ids, params, num_generated, guide)
        kv_params = self._kv_params(rid, mode)
        self._submit(seq, seq.token_ids, params, mode, num_generated, kv_params)
        return self.requests[rid]

    def add_remote(
        self,
        request: PrefilledRequest,
        num_blocks: int,
        free: int,
        total: int,
        guide: Guide | None = None,
    ) -> tuple[Request, asyncio.Future[list[int]]]:
        """A request prefilled elsewhere, waiting for vLLM to allocate its blocks (the future)
        and for its pull; its first update (the first token) is queued already."""
        rid = request.request_id
        if num_blocks > free:  # fail fast: the router tries another worker
            raise NoRoomError.of(free, total, num_blocks)
        self._intake.validate_token_ids([request.first_token_id], "first_token_id")
        seq = self._sequence(
            rid, request.prompt_token_ids, request.params, request.num_generated_tokens, guide
        )
        seq.num_cached_tokens = 0  # imported KV is not a prefix hit
        kv_params = self._kv_params(rid, Mode.REMOTE)
        kv_params.update(num_tokens=len(request.prompt_token_ids), num_blocks=num_blocks)
        tokens = [*request.prompt_token_ids, request.first_token_id]
        offset = request.num_generated_tokens + 1
        attempt = kv_params["pdserve_attempt"]
        allocation = self._bridge.expect_allocation(rid, attempt)
        try:
            req = self._submit(seq, tokens, request.params, Mode.REMOTE, offset, kv_params)
        except BaseException:
            self._bridge.load_finished(rid, attempt, ok=False)  # drops the wait
            self._bridge.forget(rid)
            raise
        # Its first update, queued before vLLM can produce any (it waits for the pull); if it
        # ends the request, vLLM's copy is aborted once the pull is over.
        first = [(request.first_token_id, request.first_token_logprobs)]
        self.accept(rid, req, first, vllm_finished=False, abort_in_vllm=False)
        return req, allocation

    def export(self, request_id: str) -> PrefilledRequest:
        return PrefilledRequest.of_pinned(self.pinned[request_id], self._bridge.pinned(request_id))

    def release(self, rid: str) -> None:
        """A pinned request's blocks go (at vLLM's next step). ``KeyError``: not pinned."""
        del self.pinned[rid]  # KeyError: not pinned (a second free)
        self._bridge.release(rid)
        self._bridge.forget(rid)

    def abort(self, rid: str) -> None:
        """Stops a request wherever it is; vLLM frees its blocks (an allocated, unfilled
        request's at its next step, once told its load is over)."""
        if rid in self.pinned:
            self.release(rid)
            return
        req = self.requests.pop(rid, None)
        if req is None:
            return
        req.done = True
        if self._bridge.is_pinned(rid, req.attempt):  # pinned, its output not delivered yet
            self._bridge.release(rid)
        if req.out.paused:  # not in vLLM
            return
        if not req.filling:  # an allocated, unfilled request's blocks go at the next step
            self._bridge.load_finished(rid, req.attempt, ok=False)
        self._core.abort([rid])
        self._bridge.forget(rid)

    def resume(self, rid: str) -> None:
        """A paused request's reader took half its queue: it goes on in vLLM, a continuation
        of everything it output (a no-op when it is not paused)."""
        req = self.requests.get(rid)
        if req is None or not req.out.paused or req.done:
            return
        req.out.paused, req.mode = False, Mode.GENERATE
        seq = req.state.seq
        kv_params = self._kv_params(rid, Mode.GENERATE)
        req.attempt = kv_params["pdserve_attempt"]
        eos = tuple(self._checkpoint.eos_token_ids)
        params = vllm_params(seq.params, Mode.GENERATE, seq.num_output_tokens, kv_params, eos)
        self._core.add(rid, list(seq.token_ids), params, seq.params.priority)

    def pin_arrived(self, rid: str, attempt: int) -> None:
        """The engine core's pin of ``rid``'s add number ``attempt`` reached the bridge: its
        held output goes on; a pin no request wants any more (it was aborted, or failed, or an
        earlier add of the id) is released at once."""
        req = self.requests.get(rid)
        if req is None or req.done or req.attempt != attempt:
            if self._bridge.is_pinned(rid, attempt):
                self._bridge.release(rid)
            return
        if req.pending is not None:
            output, req.pending = req.pending, None
            self.deliver(output)

    @property
    def num_paused(self) -> int:
        return sum(r.out.paused for r in self.requests.values())

    def stats(
        self,
        running: int,
        waiting: int,
        blocks: tuple[int, int, int],
        progress: StepProgress,
    ) -> EngineStats:
        """The engine's stats: vLLM's queue counts, ``blocks`` (total, free, cached), and
        this table's own counts."""
        num_blocks, num_free_blocks, num_cached_blocks = blocks
        return EngineStats(
            num_waiting=waiting,
            num_running=running,
            num_pinned=len(self.pinned),
            num_paused=self.num_paused,
            num_blocks=num_blocks,
            num_free_blocks=num_free_blocks,
            num_cached_blocks=num_cached_blocks,
            num_preemptions=0,
            num_prompt_tokens_computed=self.num_prompt_tokens_computed,
            num_prefix_hit_tokens=self.num_prefix_hit_tokens,
            num_steps=progress.num_steps,
        )

    def _pause_if_unread(self, rid: str, req: Request) -> None:
        """Its reader let ``max_buffered_tokens`` pile up: out of vLLM until ``resume``."""
        busy = req.done or req.out.paused or req.filling or req.mode is Mode.PREFILL
        if busy or not req.out.full(self.max_buffered_tokens):
            return
        req.out.paused = True
        self._core.abort([rid])
        self._bridge.forget(rid)

    def deliver(self, output: RequestOutput) -> None:
        """One step's output of one request."""
        rid = output.request_id
        req = self.requests.get(rid)
        if req is None or req.done or req.out.paused:
            return
        pinned = bool(output.kv_transfer_params and output.kv_transfer_params.get(PINNED_KEY))
        if pinned and not self._bridge.is_pinned(rid, req.attempt):
            req.pending = output  # delivered once the pin is here (``pin_arrived``)
            return
        seq = req.state.seq
        if not req.counted:
            req.counted = True
            if req.mode is not Mode.REMOTE:
                cached = output.num_cached_tokens or 0
                seq.num_cached_tokens = cached
                self.num_prefix_hit_tokens += cached
                self.num_prompt_tokens_computed += max(seq.num_prompt_tokens - cached, 0)
        if output.prompt_logprobs and not seq.prompt_logprobs:  # vLLM's, with its first token
            seq.prompt_logprobs = [
                lp
                for tid, position in zip(
                    seq.token_ids[1:], output.prompt_logprobs[1:], strict=False
                )
                if (lp := token_logprobs(tid, position, seq.params.prompt_logprobs)) is not None
            ]
        completion = output.outputs[0] if output.outputs else None
        token_ids = list(completion.token_ids) if completion is not None else []
        logprobs = positions(completion.logprobs if completion else None, len(token_ids))
        tokens = [
            (tid, token_logprobs(tid, lp, seq.params.logprobs))
            for tid, lp in zip(token_ids, logprobs, strict=True)
        ]
        if tokens or output.finished:
            self.accept(rid, req, tokens, vllm_finished=output.finished)

    def _kv_params(self, rid: str, mode: Mode) -> dict[str, Any]:
        """What the connector reads of one add (``vllm_engine/connector.py``)."""
        return {"pdserve_rid": rid, "pdserve_attempt": next(self._attempts), "mode": mode.value}

    def _sequence(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        num_generated: int,
        guide: Guide | None = None,
    ) -> Sequence:
        if rid in self.requests or rid in self.pinned:
            raise RequestIdInUse.of(rid)
        # pdserve's side follows the output too (a complete constraint ends the request here,
        # engine.request_state, as on the native engine); the masks are the logits
        # processor's (vllm_engine/sampler.py).
        return self._intake.sequence(Sequence, rid, prompt_ids, params, num_generated, guide=guide)

    def _submit(
        self,
        seq: Sequence,
        tokens: list[int],
        params: SamplingParams,
        mode: Mode,
        offset: int,
        kv_params: dict[str, Any],
    ) -> Request:
        state = RequestState.create(seq, self._tokenizer, self._checkpoint.eos_token_ids)
        req = Request(state, mode, kv_params["pdserve_attempt"])
        self._core.add(
            seq.request_id,
            tokens,
            vllm_params(params, mode, offset, kv_params, tuple(self._checkpoint.eos_token_ids)),
            params.priority,
        )
        self.requests[seq.request_id] = req
        return req

    def accept(
        self,
        rid: str,
        req: Request,
        tokens: list[tuple[int, Any]],
        vllm_finished: bool,
        abort_in_vllm: bool = True,
    ) -> None:
        """Appends tokens, ending the request where pdserve's rules end it, and queues the
        update. A token the request's own parameters rule out (``engine/request_state.py``)
        ends it with that error, on pdserve's side and in vLLM."""
        state, status = req.state, None
        try:
            for token_id, logprobs in tokens:
                status = state.append(
                    token_id, logprobs, self._checkpoint.eos_token_ids, self._max_model_len
                )
                if status is not None:
                    break
        except RequestError as exc:
            status = state.fail(str(exc))
            if req.mode is Mode.PREFILL:  # the connector pinned its blocks as it finished
                with contextlib.suppress(KeyError):
                    self._bridge.release(rid)
        if req.mode is Mode.PREFILL and status is not SequenceStatus.FINISHED_ERROR:
            if vllm_finished or status is not None:
                update = self._pin(rid, req, status)
            else:
                update = state.flush(None)
        elif status is not None or vllm_finished:
            status = state.finish(status or SequenceStatus.FINISHED_LENGTH)
            req.done = True
            if not vllm_finished and abort_in_vllm:
                self._core.abort([rid])
            self._bridge.forget(rid)
            update = state.flush(status.finish_reason)
        else:
            update = state.flush(None)
        req.out.put(update)
        self._pause_if_unread(rid, req)

    def _pin(self, rid: str, req: Request, status: SequenceStatus | None) -> RequestUpdate:
        """The first token is out and the connector pinned the blocks (vLLM finished the
        request at its one token): the lease owns their free now."""
        req.done = True
        self.pinned[rid] = req.state.seq
        if status is None:
            return req.state.flush(None, prefilled=True)
        status = req.state.finish(status)
        return req.state.flush(status.finish_reason, prefilled=True)
