"""Request migration: when a worker fails mid-stream, the router re-issues the request elsewhere
as the client's prompt plus every token the client already has, marked ``num_generated_tokens``.
Which failures migrate is the failure table's to say (``router/failures.py``).

The one owner of the rule (pure, no I/O; unit-tested with exact values). The engine treats the
marked tokens as its own output: the seeded sampler's output index, ``max_tokens``, stop
strings spanning the handover and logprobs all continue exactly, so the continuation is the
token stream one engine would have produced (only a logit near-tie between the two forward
paths could flip a token). Tokens count as delivered only once relayed to the client, never
from a message that did not arrive.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Finished:
    """What the client already has ends the request: nothing is left to generate."""

    reason: str  # "stop" or "length"


@dataclass(frozen=True)
class Continuation:
    """What the next worker is asked for."""

    prompt_token_ids: list[int]  # the client's prompt, then what the client already has
    num_generated_tokens: int


def continue_request(
    prompt_token_ids: list[int],
    delivered_token_ids: list[int],
    params: SamplingParams,
    eos_token_ids: tuple[int, ...],
    max_model_len: int,
    stopped: bool,
) -> Continuation | Finished:
    """The continuation of a request after its stream broke, or ``Finished`` when the tokens
    delivered already end it."""
    last = delivered_token_ids[-1] if delivered_token_ids else None
    if stopped or (last is not None and params.is_stop_token(last, eos_token_ids)):
        return Finished("stop")
    num_tokens = len(prompt_token_ids) + len(delivered_token_ids)
    if len(delivered_token_ids) >= params.max_tokens or (
        delivered_token_ids and num_tokens >= max_model_len
    ):
        return Finished("length")
    return Continuation(
        [*prompt_token_ids, *delivered_token_ids], num_generated_tokens=len(delivered_token_ids)
    )


def attempt_id(request_id: str, attempt: int) -> str:
    """Each attempt has its own id on the workers: a stalled worker that wakes up must not
    collide with the attempt that replaced it on another (or the same) worker."""
    return request_id if attempt == 0 else f"{request_id}-m{attempt}"
