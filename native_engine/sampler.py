"""The native engine's batched sampler: each row's token by the sampling rule
(``engine/sampling.py``), unseeded rows drawing their noise from one generator, and the logprobs
a request asked for (the raw model distribution's).
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
from engine.sequence import TokenLogprobs
from native_engine.kernels import fused_ops


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, requests: list[SampleRequest]
    ) -> SamplerOutput:  # logits: [num_requests, vocab] fp32
        # Logprobs are the raw model distribution's (vLLM's default, raw_logprobs), before the
        # grammar's mask and any logit processing, as the vLLM backend's are (its processor
        # runs after vLLM took them): every engine reports the same, always finite, values.
        processed = processed_logits(guided_logits(logits, requests), requests)
        if all(r.params.greedy for r in requests):
            token_ids = fused_ops.argmax(processed)
        else:
            token_ids = self._sample(processed, requests)
        ids = token_ids.tolist()
        return SamplerOutput(ids, self._logprobs(logits, token_ids, ids, requests))

    def _sample(self, logits: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
        greedy = torch.tensor([r.params.greedy for r in requests], device=logits.device)
        probs = filtered_probs(logits, requests)
        seeded = [
            row
            for row, r in enumerate(requests)
            if r.params.seed is not None and not r.params.greedy
        ]
        if fused_ops.races_here(probs):
            # Unseeded rows: one seed each from the sampler's generator, the race in parallel
            # (torch's exponential_ is one thread: 15 ms of a batch-20 step).
            seeds = torch.randint(-(2**63), 2**63 - 1, (len(requests),), generator=self._generator)
            sampled = fused_ops.exponential_race(probs, seeds)
            for row in seeded:
                noise = seeded_noise(probs.shape[-1], logits.device, requests[row])
                sampled[row] = fused_ops.argmax(probs[row : row + 1] / noise)[0]
        else:
            noise = torch.empty_like(probs)
            noise.exponential_(generator=self._generator)
            for row in seeded:
                noise[row] = seeded_noise(probs.shape[-1], logits.device, requests[row])
            sampled = fused_ops.argmax(probs / noise)
        return torch.where(greedy, fused_ops.argmax(logits), sampled)

    @staticmethod
    def _logprobs(
        logits: torch.Tensor,
        token_ids: torch.Tensor,
        ids: list[int],
        requests: list[SampleRequest],
    ) -> list[TokenLogprobs | None]:
        wanted = [r.params.logprobs for r in requests]
        if all(n is None for n in wanted):
            return [None] * len(requests)
        logp = torch.log_softmax(logits, dim=-1)
        chosen = logp.gather(1, token_ids[:, None]).squeeze(1).tolist()
        max_n = max(n or 0 for n in wanted)
        top_vals, top_ids = logp.topk(max_n, dim=-1) if max_n else (logp[:, :0], logp[:, :0])
        top_vals_l, top_ids_l = top_vals.tolist(), top_ids.long().tolist()
        out: list[TokenLogprobs | None] = []
        for row, n in enumerate(wanted):
            if n is None:
                out.append(None)
                continue
            out.append(
                TokenLogprobs(
                    token_id=ids[row],
                    logprob=chosen[row],
                    top_token_ids=tuple(top_ids_l[row][:n]),
                    top_logprobs=tuple(top_vals_l[row][:n]),
                )
            )
        return out
