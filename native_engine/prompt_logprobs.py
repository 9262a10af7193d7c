"""A prompt's logprobs (``SamplingParams.prompt_logprobs``): for each prompt token after the
first, its logprob given the tokens before it, and the top-n, from the hidden states the
prefill computes anyway; only the rows of requests that asked are turned into logits.

The model runner calls ``collect`` after each forward pass, before the step's bookkeeping
(``num_computed_tokens`` is still where the step began). Entries land on
``Sequence.prompt_logprobs`` in order, across prefill chunks; a request that wants them takes
no prefix-cache hit (``BlockManager.cached_prefix``), so no position is skipped, and one
preempted midway recomputes only what it lacks.
"""

from __future__ import annotations

import torch

from engine.sequence import TokenLogprobs
from native_engine.models.llama import LlamaFamilyForCausalLM
from native_engine.scheduler import ScheduledSeq

ROWS_PER_SLICE = 256  # positions turned into logits at a time: [256, vocab] fp32


def collect(
    model: LlamaFamilyForCausalLM, ordered: list[ScheduledSeq], hidden: torch.Tensor
) -> None:
    """``hidden``: the step's rows, in ``ordered``'s order (the runner's forward output)."""
    row = 0
    for s in ordered:
        seq, first = s.seq, row
        row += s.num_new_tokens
        if not seq.needs_prompt_logprobs or s.spec_token_ids:
            continue
        start = seq.num_computed_tokens
        # Position p's logits score token p + 1: the next wanted position is the count so far.
        lo = len(seq.prompt_logprobs)
        hi = min(start + s.num_new_tokens, seq.num_prompt_tokens - 1)
        if lo < start or lo >= hi:
            continue
        targets = seq.token_ids[lo + 1 : hi + 1]
        rows = hidden[first + lo - start : first + hi - start]
        assert seq.params.prompt_logprobs is not None
        seq.prompt_logprobs.extend(_entries(model, rows, targets, seq.params.prompt_logprobs))


def _entries(
    model: LlamaFamilyForCausalLM, rows: torch.Tensor, targets: list[int], top_n: int
) -> list[TokenLogprobs]:
    out: list[TokenLogprobs] = []
    for at in range(0, len(targets), ROWS_PER_SLICE):
        logp = torch.log_softmax(model.compute_logits(rows[at : at + ROWS_PER_SLICE]).float(), -1)
        ids = torch.tensor(targets[at : at + ROWS_PER_SLICE], device=logp.device)
        chosen = logp.gather(1, ids[:, None]).squeeze(1).tolist()
        top_values, top_ids = logp.topk(top_n, dim=-1) if top_n else (logp[:, :0], logp[:, :0])
        for k, (values, indices) in enumerate(
            zip(top_values.tolist(), top_ids.long().tolist(), strict=True)
        ):
            out.append(
                TokenLogprobs(
                    token_id=targets[at + k],
                    logprob=chosen[k],
                    top_token_ids=tuple(indices),
                    top_logprobs=tuple(values),
                )
            )
    return out
