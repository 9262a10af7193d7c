"""Where speculative tokens come from: the interface every proposer implements.

Who calls what, and who frees what:
- ``Speculator`` (``native_engine/speculator.py``) is the only caller. Each engine step, after the
  scheduler ran and before the model does, it calls ``propose`` once with the decoding requests
  it wants to speculate for, and verifies whatever comes back; a proposal is only a guess, so a
  proposer may return fewer tokens than asked (or none) and may be wrong at no cost but speed.
- A proposer may keep per-request state (the draft model's KV blocks, an n-gram index). It
  frees that state in ``release``, which the engine calls exactly once per request, when it
  finishes or is aborted (a no-op for requests never proposed for). The proposer may also drop
  a request's state on its own (to make room) and rebuild it on the next ``propose``.
- ``propose`` may read, never modify, the sequences it is given.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from native_engine.paged_sequence import PagedSequence


@dataclass(frozen=True)
class ProposalRequest:
    # The target's sequence: every token of it is known, all but the last computed.
    seq: PagedSequence
    max_tokens: int  # at most this many proposed tokens


class Proposer(abc.ABC):
    # Prompt tokens the proposer itself ran through a model (a draft model's prefill).
    num_prompt_tokens_computed: int = 0

    @abc.abstractmethod
    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]:
        """Proposed continuations, one list per request (``<= max_tokens`` each, maybe empty)."""

    def release(self, request_id: str) -> None:  # noqa: B027 (stateless proposers keep none)
        """The request is over: free what the proposer holds for it (a no-op if nothing)."""
