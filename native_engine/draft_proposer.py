"""Draft-model speculation: a second checkpoint with the same vocabulary (normally smaller; any
compatible one, the target itself included) run by this engine's own code (``LoadedModel``,
``ModelRunner``, ``BlockManager``) with its own KV cache.

Each request has a draft sequence mirroring the target's tokens. To propose, the draft first
catches up on the tokens it has not computed (on a decode worker that pulled the prompt's KV
this is the draft's own prefill of the prompt, counted in ``num_prompt_tokens_computed``; it is
chunked by the step's token budget), then decodes k tokens one batched step at a time. Each
draft token is chosen by the request's own sampler at the same output index the target will
verify it at: for seeded requests the two models then share the sampling noise, so they agree
whenever their distributions are close (greedy: whenever their argmaxes agree).

After verification the draft keeps the KV of the tokens the target accepted and drops the rest
(``BlockManager.trim``); a request whose draft KV no longer fits is dropped from the draft (it
proposes nothing, and catches up from scratch when there is room again).
"""

from __future__ import annotations

import dataclasses

from engine.config import EngineConfig
from native_engine.block_manager import BlockManager
from native_engine.loaded_model import LoadedModel
from native_engine.paged_sequence import PagedSequence
from native_engine.proposer import ProposalRequest, Proposer
from native_engine.scheduler import ScheduledSeq


@dataclasses.dataclass(eq=False)
class _Draft:
    seq: PagedSequence  # the target's tokens up to ``num_synced``, then this draft's guesses
    num_synced: int


class DraftProposer(Proposer):
    def __init__(self, config: EngineConfig, vocab_size: int, max_chunk_tokens: int) -> None:
        self.loaded = LoadedModel(config)
        draft_vocab = self.loaded.model_config.vocab_size
        if draft_vocab != vocab_size:
            raise ValueError(
                f"spec_draft_model {config.model} has vocab_size {draft_vocab}; the target's "
                f"is {vocab_size} (a draft must share the target's vocabulary)"
            )
        self.block_manager = BlockManager(
            self.loaded.num_blocks, self.loaded.block_size, enable_prefix_caching=False
        )
        self.max_chunk_tokens = max_chunk_tokens
        self._drafts: dict[str, _Draft] = {}
        self.num_prompt_tokens_computed = 0

    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]:
        budget = self.max_chunk_tokens
        first: list[ScheduledSeq] = []
        proposing: list[tuple[int, PagedSequence, int]] = []  # index, draft sequence, k
        wanted = {r.seq.request_id for r in requests}
        for i, request in enumerate(requests):
            draft = self._sync(request.seq)
            num_behind = draft.num_tokens - draft.num_computed_tokens
            chunk = min(num_behind, budget)
            if chunk <= 0:
                continue
            k = self._allocate(
                draft, chunk, request.max_tokens if chunk == num_behind else 0, wanted
            )
            if k < 0:
                self.release(request.seq.request_id)
                continue
            budget -= chunk
            first.append(ScheduledSeq(draft, chunk))
            if k:
                proposing.append((i, draft, k))
        step = first
        while step:
            self._run(step)
            step = [
                ScheduledSeq(seq, 1)
                for _, seq, k in proposing
                if len(seq.token_ids) - self._drafts[seq.request_id].num_synced < k
            ]
        proposals: list[list[int]] = [[] for _ in requests]
        for i, seq, _ in proposing:
            proposals[i] = seq.token_ids[self._drafts[seq.request_id].num_synced :]
        return proposals

    def _allocate(self, draft: PagedSequence, chunk: int, k: int, keep: set[str]) -> int:
        """Slots for the catch-up ``chunk`` and the ``k - 1`` guesses fed back in; when the
        draft cache is short, the drafts of requests not proposing now (preempted, paused,
        sitting out: they catch up again later) make room first, then fewer guesses are
        tried. Returns how many guesses the slots allow, -1 when not even the chunk fits."""
        for attempt in range(2):
            for num_guesses in (k, 1) if k > 1 else (k,):
                if self.block_manager.allocate_slots(draft, chunk + max(num_guesses - 1, 0)):
                    return num_guesses
            if attempt == 0:
                for request_id in [r for r in self._drafts if r not in keep]:
                    self.release(request_id)
        return -1

    def _run(self, scheduled: list[ScheduledSeq]) -> None:
        results = self.loaded.runner.execute(scheduled)
        for s in scheduled:
            self.num_prompt_tokens_computed += s.seq.num_prompt_tokens_in(s.num_new_tokens)
            s.seq.num_computed_tokens += s.num_new_tokens
        for result in results:
            result.scheduled.seq.token_ids.append(result.token_ids[0])

    def _sync(self, target: PagedSequence) -> PagedSequence:
        """The draft sequence of ``target``, its tokens made the target's: the KV of guesses
        the target did not accept is dropped."""
        draft = self._drafts.get(target.request_id)
        if draft is None:
            # Logprobs are the target's to report; the draft only needs its choices.
            params = dataclasses.replace(target.params, logprobs=None)
            seq = PagedSequence(
                target.request_id, list(target.prompt_token_ids), params, list(target.token_ids)
            )
            self._drafts[target.request_id] = _Draft(seq, target.num_tokens)
            return seq
        seq, common = draft.seq, draft.num_synced
        limit = min(seq.num_tokens, target.num_tokens)
        while common < limit and seq.token_ids[common] == target.token_ids[common]:
            common += 1
        del seq.token_ids[common:]
        seq.token_ids.extend(target.token_ids[common:])
        # At least the target's last token is left to run: its output is the first guess.
        seq.num_computed_tokens = min(seq.num_computed_tokens, common, target.num_tokens - 1)
        self.block_manager.trim(seq, seq.num_computed_tokens)
        draft.num_synced = target.num_tokens
        return seq

    def release(self, request_id: str) -> None:
        draft = self._drafts.pop(request_id, None)
        if draft is not None:
            self.block_manager.free(draft.seq)
