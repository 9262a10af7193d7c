"""What the router sends back for a request, before any public format: token chunks, then one
final. The gRPC servicer writes them as ``pdserve.v1.GenerateResponse``
(``router/grpc_wire.py``), the OpenAI app as its JSON bodies and events
(``router/openai/responses.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

from engine.sequence import TokenLogprobs


@dataclass(frozen=True)
class Chunk:
    """New output: tokens (none: text released at the end), their text, their logprobs."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # The client prompt's (``params.prompt_logprobs``), with the first token: entry i is
    # prompt token i + 1's.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass(frozen=True)
class Final:
    """The request's end: why, how many tokens, and where the time went."""

    request_id: str  # the client's
    finish_reason: str  # "stop" or "length" (``engine.sequence.SequenceStatus``'s names)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from a worker's prefix cache
    ttft_s: float  # arrival -> first token sent
    mean_tpot_s: float  # mean gap between later tokens
    prefill_s: float  # prefill calls (queueing + compute) as the router saw them
    transfer_s: float  # decode admissions + KV pulls as the decode workers saw them
    num_migrations: int = 0
    # Seconds by phase (``router/phases.py``, over every attempt): those before the first
    # token add up to ttft_s.
    phases: dict[str, float] = field(default_factory=dict)


Result: TypeAlias = Chunk | Final
