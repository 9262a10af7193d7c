"""Why two correct runs may differ: how close the sampler's choice at one position was.

Two forward paths (a prefill and a decode step, two batch shapes) round differently by ~1e-5,
so a choice whose winning margin is that small can flip between them without either being
wrong. Tests and benchmarks that compare runs token for token use this to tell such a near-tie
from a real mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling import (
    SampleRequest,
    filtered_probs,
    guided_logits,
    processed_logits,
    seeded_noise,
)
from engine.sampling_params import SamplingParams
from engine.token_bans import min_tokens_ids
from native_engine.llm_engine import LLMEngine
from native_engine.paged_sequence import PagedSequence
from native_engine.scheduler import ScheduledSeq

NEAR_TIE = 1e-4


@dataclass(frozen=True)
class Choice:
    token_id: int  # what the sampler picks at that position
    margin: float  # how far it beat the runner-up, in log space


def sampler_choice(
    engine: LLMEngine, prompt: list[int], output: list[int], index: int, params: SamplingParams
) -> Choice:
    """The token the sampler chooses at output position ``index`` (given ``output`` before it)
    and how far it beats the runner-up, in log space: the logit gap for greedy, the gap of the
    exponential race's log scores (log p - log q) for seeded sampling. Uses free blocks of
    ``engine`` and gives them back."""
    row = sequence_logits(engine, [*prompt, *output[:index]], params)[-1:]  # [1, vocab]
    allowed = None
    if params.structured is not None:  # the grammar's mask after output[:index]
        guide = engine.loaded.guides.guide(params.structured, output[:index], params.ignore_eos)
        allowed = guide.masks((), 1)[0]
    stop_ids = min_tokens_ids(params, engine.runner.eos_token_ids)
    request = SampleRequest(params, index, prompt, output[:index], stop_ids, allowed)
    row = guided_logits(row, [request])
    row = processed_logits(row, [request])  # penalties, bias, min_tokens: as the sampler does
    if params.greedy:
        scores = row[0].double()
    else:
        probs = filtered_probs(row, [request])[0]
        noise = seeded_noise(probs.shape[-1], probs.device, request)
        scores = probs.double().log() - noise.double().log()
    top = scores.topk(2)
    return Choice(int(top.indices[0]), float(top.values[0] - top.values[1]))


def sequence_logits(
    engine: LLMEngine, token_ids: list[int], params: SamplingParams | None = None
) -> torch.Tensor:  # [len(token_ids), vocab] float32
    """The logits after every position of ``token_ids``, from one prefill through the engine's
    own cache (so a quantized cache's reads are in them). Uses free blocks of ``engine`` and
    gives them back."""
    seq = PagedSequence("diagnostics", token_ids, params or SamplingParams(max_tokens=1))
    if not engine.block_manager.allocate_slots(seq, len(token_ids)):
        raise RuntimeError("no free KV blocks for the diagnostic forward pass")
    engine.sync_host_tier()  # pending host-tier copies of these blocks finish first
    try:
        _, logits = engine.runner.forward_logits([ScheduledSeq(seq, len(token_ids))])
    finally:
        engine.block_manager.free(seq)
    return logits.float()


@dataclass(frozen=True)
class Agreement:
    """Teacher-forced greedy agreement of one engine with a reference's greedy output."""

    num_positions: int
    num_matching: int  # positions whose argmax is the reference's token
    first_divergence: int  # the first position that differs (num_positions when none)
    max_logit_error: float  # the largest |logit - reference logit| over those positions

    @property
    def rate(self) -> float:
        return self.num_matching / self.num_positions


def teacher_forced_agreement(
    reference: LLMEngine, engine: LLMEngine, prompt: list[int], output: list[int]
) -> Agreement:
    """Feeds both engines the prompt plus the reference's greedy ``output`` and compares, at
    each of ``len(output)`` positions, ``engine``'s argmax with the reference's token (how a
    quantized cache is judged: one early flip must not count every later token as wrong)."""
    tokens = [*prompt, *output[:-1]]
    start = len(prompt) - 1  # the row whose logits chose output[0]
    ours = sequence_logits(engine, tokens)[start:]  # [len(output), vocab]
    theirs = sequence_logits(reference, tokens)[start:]
    matches = [int(i) == t for i, t in zip(ours.argmax(dim=-1).tolist(), output, strict=True)]
    return Agreement(
        num_positions=len(output),
        num_matching=sum(matches),
        first_divergence=matches.index(False) if not all(matches) else len(output),
        max_logit_error=float((ours - theirs).abs().max()),
    )


def first_difference(a: list[int], b: list[int]) -> int:
    """The first index where two token lists differ (the shorter length if one extends the
    other); ``len(a)`` when they are equal."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
