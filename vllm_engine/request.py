"""A pdserve request as vLLM runs it: the vLLM request's parameters, and vLLM's per-step output
turned into pdserve's tokens and logprobs (``engine.request_state`` decides what they mean).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from vllm import SamplingParams as VllmParams
from vllm.logprobs import Logprob
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind

from engine.request_state import RequestState
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, TokenLogprobs
from engine.update_queue import UpdateQueue
from vllm_engine.sampler import EXTRA_ARGS_KEY, sampling_extra_args

# The key vLLM passes on to the connector (``Request.kv_transfer_params``).
KV_PARAMS_KEY = "kv_transfer_params"
# What the connector returns for a prefill whose blocks it pinned (``RequestOutput``'s
# ``kv_transfer_params``).
PINNED_KEY = "pdserve_pinned"


class Mode(enum.Enum):
    """How a request uses the connector."""

    GENERATE = "generate"  # prefill and decode here
    PREFILL = "prefill"  # first token, then its blocks stay pinned for a pull
    REMOTE = "remote"  # its prompt's KV is pulled into blocks vLLM allocates for it


@dataclass(eq=False)
class Request:
    state: RequestState[Sequence]
    mode: Mode
    attempt: int  # its add's number (``RequestTable``; a resume adds it again)
    # Its updates to its stream; ``out.paused``: its reader let the bound pile up, so it is
    # not in vLLM now (seat and blocks given back), its state kept here until
    # ``RequestTable.resume`` re-adds it as a continuation.
    out: UpdateQueue = field(default_factory=UpdateQueue)
    counted: bool = False  # its prompt tokens are in the engine's counters
    filling: bool = False  # REMOTE: the pull is writing its blocks
    done: bool = False  # pdserve ended it; whatever vLLM still says is dropped
    # PREFILL: its last output, held until the engine core's pin of its blocks is here (an
    # engine core in a process of its own says it over another channel).
    pending: RequestOutput | None = None


def vllm_params(
    params: SamplingParams,
    mode: Mode,
    offset: int,
    kv_params: dict[str, Any],
    eos_token_ids: tuple[int, ...],
) -> VllmParams:
    """vLLM's side of a pdserve request: greedy over logits pdserve's sampler decided
    (``vllm_engine.sampler``), no text, no stop of its own but the length; ``offset``: output
    tokens the request had before this engine's first."""
    max_tokens = 1 if mode is Mode.PREFILL else max(params.max_tokens - offset, 1)
    return VllmParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
        logprobs=params.logprobs,
        # The client's prompt only (not a continuation's, nor one prefilled elsewhere).
        prompt_logprobs=params.prompt_logprobs if offset == 0 and mode is not Mode.REMOTE else None,
        extra_args={
            EXTRA_ARGS_KEY: sampling_extra_args(params, offset, eos_token_ids),
            KV_PARAMS_KEY: kv_params,
        },
    )


def token_logprobs(
    token_id: int, position: dict[int, Logprob] | None, num_top: int | None
) -> TokenLogprobs | None:
    """vLLM's logprobs of one position (the sampled token's and the top ``num_top``, by rank)."""
    if num_top is None or position is None:
        return None
    top = sorted(
        ((lp.rank, tid, lp.logprob) for tid, lp in position.items() if lp.rank is not None),
        key=lambda entry: entry[0],
    )[:num_top]
    return TokenLogprobs(
        token_id=token_id,
        logprob=position[token_id].logprob,
        top_token_ids=tuple(tid for _, tid, _ in top),
        top_logprobs=tuple(lp for _, _, lp in top),
    )


def positions(logprobs: Seq[dict[int, Logprob] | None] | None, n: int) -> list[Any]:
    """One logprobs entry per new token (None when none were asked for)."""
    if logprobs is None:
        return [None] * n
    return [logprobs[i] for i in range(n)]
