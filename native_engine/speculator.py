"""Speculative decoding inside the engine step: propose, verify exactly, roll back.

Per step (``LLMEngine.step``), after the scheduler and before the model:
1. ``plan``: for each decoding request that speculates (``native_engine/spec_policy.py``), the
   proposer guesses up to k next tokens; the request's step becomes the last token plus the
   guesses (a short multi-token extend through the paged-KV prefill path), with slots for all
   of them.
   Guesses never preempt anything: a request whose extra slots do not fit verifies fewer.
2. The runner samples every position with the request's own sampler at its output index.
3. ``accept``: a guess is kept iff it is the token the sampler chose there; the kept prefix and
   the model's own next token are the step's output, exactly what plain decoding would have
   produced one step at a time (the sampler is a pure function of logits, seed and output
   index). The engine then counts only kept tokens as computed and ``trim``s the slots of the
   rejected ones, so prefix-cache hashes only ever cover accepted tokens.
4. ``record``: once appended (a stop may end the request inside the kept run), the tokens the
   step output beyond its first count as accepted.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from engine.config import EngineConfig, SpecMethod, SpeculativeConfig
from engine.kv_layout import KVCacheLayout
from engine.model_config import ModelConfig
from native_engine.block_manager import BlockManager
from native_engine.model_runner import SeqSamples
from native_engine.ngram_proposer import NgramProposer
from native_engine.paged_sequence import PagedSequence
from native_engine.proposer import ProposalRequest, Proposer
from native_engine.scheduler import ScheduledSeq
from native_engine.spec_policy import AcceptanceState, batch_speculates, num_to_propose


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer,
        block_manager: BlockManager,
        max_model_len: int,
    ) -> None:
        self.config = config
        self.proposer = proposer
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self._states: dict[str, AcceptanceState] = {}
        self.num_proposed_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verifications = 0  # (request, step) pairs that verified proposed tokens

    def plan(self, scheduled: list[ScheduledSeq], budget_tokens: int) -> list[ScheduledSeq]:
        """``scheduled`` with proposed tokens added to the decoding requests that speculate;
        ``budget_tokens``: what the step's token budget has left for them."""
        decoding = [
            i
            for i, s in enumerate(scheduled)
            if s.num_new_tokens == 1 and s.completes_sequence and not s.seq.prefill_only
        ]
        if not batch_speculates(len(decoding), self.config.max_batch_size):
            return scheduled
        wanted: list[tuple[int, ProposalRequest]] = []
        for i in decoding:
            seq = scheduled[i].seq
            state = self._states.setdefault(seq.request_id, AcceptanceState())
            if not state.wants_to_speculate():
                state.step_skipped()
                continue
            k = num_to_propose(
                state.num_guesses(self.config.num_speculative_tokens, self.config.min_acceptance),
                seq.num_output_tokens,
                seq.params.max_tokens,
                seq.num_tokens,
                self.max_model_len,
            )
            # Slots first: nobody guesses more than this step can verify.
            k = self._fit(seq, min(k, budget_tokens))
            if k:
                budget_tokens -= k
                wanted.append((i, ProposalRequest(seq, k)))
        if not wanted:
            return scheduled
        proposals = self.proposer.propose([r for _, r in wanted])
        planned = list(scheduled)
        for (i, request), tokens in zip(wanted, proposals, strict=True):
            seq = request.seq
            tokens = tokens[: request.max_tokens]
            if tokens:
                planned[i] = ScheduledSeq(seq, 1 + len(tokens), tuple(tokens))
            else:  # nothing to verify: only the last token's slot is needed
                self.block_manager.trim(seq, seq.num_computed_tokens + 1)
        return planned

    def _fit(self, seq: PagedSequence, num_tokens: int) -> int:
        """Slots for up to ``num_tokens`` guesses after the last token: new blocks if free,
        else what the sequence's last block has left (never a preemption). Returns how many."""
        if num_tokens <= 0:
            return 0
        if self.block_manager.allocate_slots(seq, 1 + num_tokens):
            return num_tokens
        room = len(seq.block_table) * self.block_manager.block_size - seq.num_computed_tokens - 1
        return max(0, min(num_tokens, room))

    def accept(self, result: SeqSamples) -> int:
        """How many of the verified guesses are kept: the longest prefix the sampler agrees
        with. The engine appends them, then ``record``s how many it output."""
        guesses = result.scheduled.spec_token_ids
        num_accepted = 0
        while (
            num_accepted < len(guesses) and result.token_ids[num_accepted] == guesses[num_accepted]
        ):
            num_accepted += 1
        return num_accepted

    def record(self, scheduled: ScheduledSeq, num_accepted: int) -> None:
        """One verification, for the request's adaptivity and the metrics: ``num_accepted``
        is how many tokens the step output beyond its first, so a guess kept past a stop
        (verified, but not a token anyone gets) is not counted."""
        self.num_proposed_tokens += len(scheduled.spec_token_ids)
        self.num_accepted_tokens += num_accepted
        self.num_verifications += 1
        scheduled.seq.num_spec_proposed_tokens += len(scheduled.spec_token_ids)
        scheduled.seq.num_spec_accepted_tokens += num_accepted
        state = self._states.get(scheduled.seq.request_id)  # None once finished
        if state is not None:
            state.verified(len(scheduled.spec_token_ids), num_accepted, self.config.min_acceptance)

    def stats_fields(self) -> dict[str, int]:
        """This speculator's part of ``EngineStats``."""
        return {
            "num_spec_proposed_tokens": self.num_proposed_tokens,
            "num_spec_accepted_tokens": self.num_accepted_tokens,
            "num_spec_verifications": self.num_verifications,
            "num_draft_prompt_tokens_computed": self.proposer.num_prompt_tokens_computed,
        }

    def release(self, request_id: str) -> None:
        """The request finished or was aborted (called exactly once per request)."""
        self._states.pop(request_id, None)
        self.proposer.release(request_id)


def draft_block_bytes(config: EngineConfig) -> int:
    """Bytes the draft model's cache spends per target block (0 without a draft): the
    target's cache is sized so that both fit the memory budget. The draft's weights load after
    the target's cache; they must fit what the budget leaves (15 % of free GPU memory, or set
    ``kv_cache_bytes``)."""
    spec = config.speculative
    if spec is None or spec.draft_model is None:
        return 0
    try:
        draft = ModelConfig.from_dir(Path(spec.draft_model))
    except (OSError, ValueError) as exc:
        raise ValueError(f"spec_draft_model {spec.draft_model}: {exc}") from exc
    layout = KVCacheLayout(
        "draft",
        config.dtype,
        config.cache.block_size,
        draft.num_layers,
        draft.num_kv_heads,
        draft.head_dim,
        config.cache.kv_cache_dtype,
    )
    return layout.block_bytes


def make_speculator(
    config: EngineConfig, block_manager: BlockManager, vocab_size: int, max_model_len: int
) -> Speculator | None:
    spec = config.speculative
    if spec is None:
        return None
    proposer: Proposer
    if spec.method is SpecMethod.NGRAM:
        proposer = NgramProposer(spec.ngram_min, spec.ngram_max)
    else:
        from native_engine.draft_proposer import (
            DraftProposer,  # loads a second model: only if asked
        )

        assert spec.draft_model is not None
        draft_config = dataclasses.replace(
            config,
            model=spec.draft_model,
            max_model_len=max_model_len,
            # As many tokens as the target's cache holds: any sequence it runs fits the draft.
            cache=dataclasses.replace(
                config.cache,
                num_blocks=block_manager.num_blocks,
                enable_prefix_caching=False,
                host_cache_gib=0.0,  # the draft's own cache has no host tier
            ),
            speculative=None,
        )
        proposer = DraftProposer(draft_config, vocab_size, config.scheduler.max_num_batched_tokens)
    return Speculator(spec, proposer, block_manager, max_model_len)
