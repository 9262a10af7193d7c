"""One worker in simulated time: pdserve's own ``Scheduler`` and ``BlockManager`` decide every
step (batching, chunked prefill, preemption, prefix hits), the profile says how long the step
takes. The bookkeeping after a step mirrors ``LLMEngine.step`` (tokens computed, blocks
registered, a token appended, the request finished or pinned), minus the model.

Roles: a prefill worker's requests end pinned after their first token (their blocks wait for
the transfer, then ``free_pinned``); a decode worker takes prefilled requests (``reserve`` then
``start_prefilled``) and may prefill short prompts itself; a colocated worker does both.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from app.capacity.profile import Profile, StepShape
from engine.block_hash import BlockHash
from engine.config import SchedulerConfig
from engine.sampling_params import SamplingParams
from engine.sequence import SequenceStatus
from native_engine.block_manager import BlockManager
from native_engine.paged_sequence import PagedSequence
from native_engine.scheduler import ScheduledSeq, Scheduler

# The token every simulated step samples: its value matters to nothing but block hashes.
SIM_TOKEN_ID = 17


class WorkerKind(enum.Enum):
    """A simulated worker's part: a pool's (``pdserve.common.role.Role``), or both phases."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


class Outcome(enum.Enum):
    TOKEN = "token"  # a token for the client; the request goes on
    FINISHED = "finished"  # its last token; blocks freed
    PREFILLED = "prefilled"  # first token of a prefill-only request; blocks pinned


@dataclass(frozen=True)
class StepResult:
    seq: PagedSequence
    outcome: Outcome


def new_sequence(request_id: str, prompt: list[int], output_len: int) -> PagedSequence:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    return PagedSequence(request_id, list(prompt), params)


class SimWorker:
    def __init__(self, name: str, kind: WorkerKind, profile: Profile, root: BlockHash) -> None:
        self.name = name
        self.kind = kind
        self.profile = profile
        self.root = root
        self.block_manager = BlockManager(profile.num_blocks, profile.block_size, True)
        config = SchedulerConfig(profile.max_num_seqs, profile.max_num_batched_tokens)
        self.scheduler = Scheduler(config, self.block_manager)
        self.busy = False  # a step is in flight
        self._scheduled: list[ScheduledSeq] = []
        self.num_steps = 0

    def _hash(self, seq: PagedSequence) -> None:
        seq.update_block_hashes(self.root, self.profile.block_size)

    # ---- requests ------------------------------------------------------------------------
    def add(self, seq: PagedSequence, prefill_only: bool) -> None:
        seq.prefill_only = prefill_only
        self._hash(seq)
        self.scheduler.add(seq)

    def cached_tokens(self, seq: PagedSequence) -> int:
        """What this worker's prefix cache would serve of the prompt (the router's index
        view, exact): never the last token, which must be computed."""
        self._hash(seq)
        return len(self.block_manager.cached_prefix(seq)) * self.profile.block_size

    def reserve(self, seq: PagedSequence) -> bool:
        """Decode side: blocks for a prefilled prompt (``LLMEngine.reserve_prefilled``)."""
        if not self.block_manager.allocate_slots(seq, seq.num_tokens):
            return False
        seq.num_cached_tokens = 0
        return True

    def start_prefilled(self, seq: PagedSequence) -> Outcome:
        """The KV arrived: the request joins the batch with its first token appended."""
        seq.num_computed_tokens = seq.num_tokens
        self._hash(seq)
        self.block_manager.register_computed_blocks(seq)
        seq.token_ids.append(SIM_TOKEN_ID)
        self._hash(seq)
        if seq.num_output_tokens >= seq.params.max_tokens:
            seq.status = SequenceStatus.FINISHED_LENGTH
            self.block_manager.free(seq)
            return Outcome.FINISHED
        self.scheduler.add_ready(seq)
        return Outcome.TOKEN

    def free_pinned(self, seq: PagedSequence) -> None:
        self.block_manager.free(seq)

    # ---- steps ---------------------------------------------------------------------------
    def begin_step(self) -> float | None:
        """Schedules a step; its duration, or None when nothing can run now."""
        out = self.scheduler.schedule()
        for seq in out.dropped:  # never fits: finished as "length", as the engine does
            self.block_manager.free(seq)
        if out.is_empty:
            return None
        self.busy = True
        self._scheduled = out.scheduled
        self.num_steps += 1
        return self.profile.step_s(shape_of(out.scheduled))

    def end_step(self) -> list[StepResult]:
        """The step's results, as ``LLMEngine.step`` applies them."""
        results = []
        for s in self._scheduled:
            seq = s.seq
            completes = s.completes_sequence
            seq.num_computed_tokens += s.num_new_tokens
            self.block_manager.register_computed_blocks(seq)
            if completes:
                results.append(StepResult(seq, self._append(seq)))
        self._scheduled = []
        self.busy = False
        return results

    def _append(self, seq: PagedSequence) -> Outcome:
        seq.token_ids.append(SIM_TOKEN_ID)
        self._hash(seq)
        if seq.num_output_tokens >= seq.params.max_tokens:
            seq.status = SequenceStatus.FINISHED_LENGTH
            self.scheduler.remove(seq)
            if seq.prefill_only:
                return Outcome.PREFILLED  # finished at its first token: still pinned
            self.block_manager.free(seq)
            return Outcome.FINISHED
        if seq.prefill_only:
            self.scheduler.remove(seq)
            return Outcome.PREFILLED
        return Outcome.TOKEN

    @property
    def num_inflight(self) -> int:
        s = self.scheduler
        return len(s.waiting) + len(s.running) + len(s.ready)


def shape_of(scheduled: list[ScheduledSeq]) -> StepShape:
    """A batch as the profile's features see it: decode tokens (one token after outputs) and
    prompt chunks (with the context they attend to)."""
    new_tokens, new_x_context, num_decode, decode_context = 0, 0.0, 0, 0.0
    for s in scheduled:
        seq = s.seq
        is_decode = (
            s.num_new_tokens == 1
            and seq.num_output_tokens > 0
            and seq.num_computed_tokens == seq.num_tokens - 1
        )
        if is_decode:
            num_decode += 1
            decode_context += seq.num_tokens
        else:
            new_tokens += s.num_new_tokens
            new_x_context += s.num_new_tokens * (seq.num_computed_tokens + s.num_new_tokens)
    return StepShape(new_tokens, new_x_context / 1e3, num_decode, decode_context / 1e3)
