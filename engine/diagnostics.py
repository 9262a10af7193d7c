"""Why two correct runs may differ: how close the sampler's choice at one position was.

Two forward paths (a prefill and a decode step, two batch shapes) round differently by ~1e-5,
so a choice whose winning margin is that small can flip between them without either being
wrong. Tests and benchmarks that compare runs token for token use this to tell such a near-tie
from a real mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.llm_engine import LLMEngine
from engine.sampler import SampleRequest, filtered_probs, seeded_noise
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence

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
    tokens = [*prompt, *output[:index]]
    seq = Sequence("winning-margin", tokens, params)
    if not engine.block_manager.allocate_slots(seq, len(tokens)):
        raise RuntimeError("no free KV blocks for the margin check")
    engine.sync_host_tier()  # pending host-tier copies of these blocks finish first
    try:
        _, logits = engine.runner.forward_logits([ScheduledSeq(seq, len(tokens))])
    finally:
        engine.block_manager.free(seq)
    row = logits[-1:].float()  # [1, vocab]
    if params.greedy:
        scores = row[0].double()
    else:
        request = SampleRequest(params, index)
        probs = filtered_probs(row, [request])[0]
        noise = seeded_noise(probs.shape[-1], probs.device, request)
        scores = probs.double().log() - noise.double().log()
    top = scores.topk(2)
    return Choice(int(top.indices[0]), float(top.values[0] - top.values[1]))


def first_difference(a: list[int], b: list[int]) -> int:
    """The first index where two token lists differ (the shorter length if one extends the
    other); ``len(a)`` when they are equal."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
