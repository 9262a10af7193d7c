"""pdserve's sampler inside vLLM: a logits processor that picks each token with pdserve's
stateless seeded sampler (``engine.sampler``: the noise is a function of (seed, output index)
alone) and leaves vLLM only that token to choose.

vLLM runs every pdserve request greedily (temperature 0) over logits this processor has already
reduced to one finite entry, so vLLM's own per-request generator (stateful: it would restart on
a decode worker and after a migration) is never used. A greedy pdserve request is left alone:
vLLM's argmax is pdserve's greedy rule. Logprobs are vLLM's raw ones, taken before any
processor runs. A request's output index is the tokens it produced before this engine saw it
(``offset``: its earlier output after a migration, plus the first token on a decode worker) plus
what vLLM has generated for it so far.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from engine.sampler import SampleRequest, filtered_probs, seeded_noise
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import vllm
    from vllm.config import VllmConfig

# The key of pdserve's sampling settings in a vLLM request's SamplingParams.extra_args.
EXTRA_ARGS_KEY = "pdserve_sampling"


def sampling_extra_args(params: SamplingParams, offset: int) -> dict[str, Any]:
    """What the processor needs of a request, as vLLM carries it (plain values)."""
    seed = params.seed if params.seed is not None else random.getrandbits(63)
    return {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "seed": seed,
        "offset": offset,
    }


@dataclass
class _Row:
    params: SamplingParams
    offset: int
    output_ids: list[int]  # vLLM's live list of the request's generated tokens

    def request(self) -> SampleRequest:
        return SampleRequest(self.params, self.offset + len(self.output_ids))


class PdserveSampler(LogitsProcessor):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self._rows: dict[int, _Row] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it picks the token itself

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._rows.pop(index, None)
        for index, params, _, output_ids in batch_update.added:
            row = _row(params, output_ids)
            if row is None:
                self._rows.pop(index, None)
            else:
                self._rows[index] = row
        for a, b, direction in batch_update.moved:
            row_a, row_b = self._rows.pop(a, None), self._rows.pop(b, None)
            if row_a is not None:
                self._rows[b] = row_a
            if direction is MoveDirectionality.SWAP and row_b is not None:
                self._rows[a] = row_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows = sorted(i for i in self._rows if i < logits.shape[0])
        if not rows:
            return logits
        requests = [self._rows[i].request() for i in rows]
        probs = filtered_probs(logits[rows], requests)
        noise = torch.stack([seeded_noise(probs.shape[-1], logits.device, r) for r in requests])
        tokens = (probs / noise).argmax(dim=-1)
        index = torch.tensor(rows, device=logits.device)
        chosen = torch.full_like(logits[rows], float("-inf"))
        chosen.scatter_(1, tokens[:, None], 0.0)
        logits.index_copy_(0, index, chosen)
        return logits


def _row(params: vllm.SamplingParams | None, output_ids: list[int]) -> _Row | None:
    extra = (params.extra_args or {}).get(EXTRA_ARGS_KEY) if params is not None else None
    if extra is None:
        return None
    ours = SamplingParams(
        max_tokens=1,  # unused here: lengths and stops are pdserve's (engine.request_state)
        temperature=extra["temperature"],
        top_p=extra["top_p"],
        top_k=extra["top_k"],
        min_p=extra["min_p"],
        seed=extra["seed"],
    )
    if ours.greedy:
        return None  # vLLM's argmax is pdserve's greedy
    return _Row(ours, int(extra["offset"]), output_ids)
