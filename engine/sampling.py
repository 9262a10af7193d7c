"""The sampling rule every engine follows: logit processing (bad_words, min_tokens,
logit_bias, penalties), a grammar's mask, temperature, min-p, top-k, top-p, and the seeded
choice. The native engine's batched ``Sampler`` (``native_engine/sampler.py``) and the vLLM
engine's logits processor (``vllm_engine/sampler.py``) both choose through it.

Sampling uses the exponential race: token = argmax(p / q) with q ~ Exp(1) i.i.d., which draws
from p exactly. A seeded request's noise comes from a generator seeded by (seed, output index)
alone, so its tokens do not depend on batch composition, on preemption, or on which process
runs the step: a decode worker resuming a prefilled request needs no generator state beyond the
number of tokens already generated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams
from engine.token_bans import banned_ids

_MASK64 = (1 << 64) - 1


def step_seed(seed: int, output_index: int) -> int:
    """SplitMix64 of (seed, index): decorrelated streams for consecutive steps."""
    z = (seed * 0x9E3779B97F4A7C15 + (output_index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass(frozen=True)
class SampleRequest:
    params: SamplingParams
    output_index: int  # how many tokens this request has generated before this one
    # For logit processing only (``params.processes_logits``), else empty: the request's
    # prompt, its output before this token (a verified guess's row: the guesses before it
    # too), and the ids min_tokens masks (its stop ids and, unless ignore_eos, EOS).
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    stop_ids: tuple[int, ...] = ()
    # Guided decoding (``params.structured``): ``[vocab]`` bool, the tokens its grammar
    # allows at this row (engine/guide.py); None: no constraint.
    allowed: torch.Tensor | None = None


def guided_logits(logits: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
    """``logits`` with every token a guided row's grammar forbids at -inf (no copy when no
    row is guided)."""
    rows = [i for i, r in enumerate(requests) if r.allowed is not None]
    if not rows:
        return logits
    out = logits.clone()
    for row in rows:
        allowed = requests[row].allowed
        assert allowed is not None
        vocab = min(allowed.shape[-1], out.shape[-1])
        out[row, :vocab].masked_fill_(~allowed[:vocab].to(out.device), float("-inf"))
        out[row, vocab:] = float("-inf")  # ids past the tokenizer's table: never text
    return out


def processed_logits(logits: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
    """``logits`` (``[rows, vocab]``) after each row's logit processing, in vLLM v1's order:
    bad_words (a word's last token masked where the output ends with the rest of it),
    min_tokens (stop ids masked while fewer tokens are out), logit_bias (added), then the
    repetition penalty (over prompt and output ids: positive logits divided, negative
    multiplied), the frequency penalty (times each id's count in the output) and the presence
    penalty (once per id in the output). Rows without any: untouched (no copy at all when
    no row has any). A function of the request's own tokens only: exact across processes."""
    rows = [i for i, r in enumerate(requests) if r.params.processes_logits]
    if not rows:
        return logits
    out = logits.clone()
    vocab = logits.shape[-1]
    for row in rows:
        r, p = requests[row], requests[row].params
        # bad_words and min_tokens: one rule (engine/token_bans.py), which a request's output
        # also checks its tokens against. vLLM applies bad_words first; masks commute anyway.
        banned = banned_ids(p, r.output_ids, r.stop_ids)
        if banned:
            out[row, sorted(banned)] = float("-inf")
        if p.logit_bias:
            ids, biases = zip(*p.bias, strict=True)
            index = torch.tensor(ids, device=out.device)
            out[row, index] += torch.tensor(biases, device=out.device, dtype=out.dtype)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted({*r.prompt_ids, *r.output_ids}), device=out.device)
            if seen.numel():
                values = out[row, seen]
                penalty = p.repetition_penalty
                out[row, seen] = torch.where(values > 0, values / penalty, values * penalty)
        if (p.frequency_penalty or p.presence_penalty) and r.output_ids:
            output = torch.tensor(list(r.output_ids), device=out.device)
            counts = torch.bincount(output, minlength=vocab)[:vocab].to(out.dtype)
            out[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return out


def seeded_choice(logits: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
    """Each row's token where every sampling row is seeded (another engine's processor: no
    generator of its own): after logit processing, a greedy row's argmax, a sampling row's
    exponential race with its seeded noise, as the native ``Sampler`` chooses."""
    processed = processed_logits(guided_logits(logits, requests), requests)
    greedy = [r.params.greedy for r in requests]
    if all(greedy):
        return processed.argmax(dim=-1)
    probs = filtered_probs(processed, requests)
    vocab = probs.shape[-1]
    noise = torch.stack(
        [
            torch.ones(vocab, device=probs.device) if g else seeded_noise(vocab, probs.device, r)
            for g, r in zip(greedy, requests, strict=True)
        ]
    )
    sampled = (probs / noise).argmax(dim=-1)
    mask = torch.tensor(greedy, device=probs.device)
    return torch.where(mask, processed.argmax(dim=-1), sampled)


def filtered_probs(logits: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
    """Each row's sampling distribution: ``[rows, vocab]`` logits through the request's
    temperature, then (vLLM v1's order) min-p, top-k and top-p, then softmax."""
    vocab = logits.shape[-1]
    temps = torch.tensor(
        [r.params.temperature if not r.params.greedy else 1.0 for r in requests],
        device=logits.device,
    )
    scaled = logits / temps[:, None]
    if any(r.params.min_p > 0.0 for r in requests):
        scaled = _apply_min_p(scaled, [r.params.min_p for r in requests])
    if any(0 < r.params.top_k < vocab for r in requests):
        scaled = _apply_top_k(scaled, [r.params.top_k for r in requests])
    if any(r.params.top_p < 1.0 for r in requests):
        scaled = _apply_top_p(scaled, [r.params.top_p for r in requests])
    return torch.softmax(scaled, dim=-1)


def seeded_noise(vocab: int, device: torch.device, request: SampleRequest) -> torch.Tensor:
    """A seeded request's Exp(1) noise at its output index: ``[vocab]`` fp32, the same in
    every process and batch."""
    assert request.params.seed is not None
    generator = torch.Generator(device=device)
    generator.manual_seed(step_seed(request.params.seed, request.output_index))
    return torch.empty(vocab, device=device).exponential_(generator=generator)


def _apply_min_p(logits: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    min_p = torch.tensor(min_ps, device=logits.device, dtype=torch.float32)
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def _apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=logits.device)
    sorted_desc = logits.sort(dim=-1, descending=True).values
    kth = sorted_desc.gather(1, (ks - 1)[:, None])  # [rows, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    p = torch.tensor(top_ps, device=logits.device, dtype=torch.float32)
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Drop the low tail whose total mass is <= 1 - p; the top token always survives.
    drop = cum <= (1 - p)[:, None]
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
