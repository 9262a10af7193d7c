"""pdserve's sampler inside vLLM: a logits processor that picks each token with pdserve's
stateless seeded sampler (``engine.sampling``: the noise is a function of (seed, output index)
alone), pdserve's logit processing (penalties, logit_bias, min_tokens: a function of the
request's own tokens) and its grammar's mask (structured outputs: the matcher is advanced by
every token vLLM produced for the request), and leaves vLLM only that token to choose.

vLLM runs every pdserve request greedily (temperature 0, none of its own penalties) over logits
this processor has already reduced to one finite entry, so vLLM's own per-request generator
(stateful: it would restart on a decode worker and after a migration) is never used, nor its
penalties (which would count a continuation's earlier output as prompt). A greedy request
without logit processing is left alone: vLLM's argmax is pdserve's greedy rule. Logprobs are
vLLM's raw ones, taken before any processor runs, as the native engine's are. A request's
output is the tokens it produced before this engine saw it (the last ``offset`` tokens vLLM
holds as its prompt: its earlier output after a migration, plus the first token on a decode
worker) followed by what vLLM has generated for it so far.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from engine.checkpoint import CheckpointInfo
from engine.guide import Guide, GuideCompiler
from engine.request_error import RequestError
from engine.sampling import SampleRequest, seeded_choice
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredKind, StructuredOutput
from engine.token_bans import min_tokens_ids

if TYPE_CHECKING:
    import vllm
    from vllm.config import VllmConfig

# The key of pdserve's sampling settings in a vLLM request's SamplingParams.extra_args.
EXTRA_ARGS_KEY = "pdserve_sampling"


def sampling_extra_args(
    params: SamplingParams, offset: int, eos_token_ids: tuple[int, ...]
) -> dict[str, Any]:
    """What the processor needs of a request, as vLLM carries it (plain values)."""
    seed = params.seed if params.seed is not None else random.getrandbits(63)
    return {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "seed": seed,
        "offset": offset,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "logit_bias": [list(pair) for pair in params.bias],
        "min_tokens": params.min_tokens,
        "stop_ids": list(min_tokens_ids(params, eos_token_ids)),
        "bad_words": [list(word) for word in params.bad_words or ()],
        "structured": _structured_args(params.structured),
        "ignore_eos": params.ignore_eos,
    }


def _structured_args(so: StructuredOutput | None) -> list[str] | None:
    return None if so is None else [so.kind.value, so.spec, so.field]


@dataclass
class _Row:
    params: SamplingParams
    offset: int
    output_ids: list[int]  # vLLM's live list of the request's generated tokens
    # For logit processing only, else empty: vLLM's prompt split into the request's own
    # prompt and its earlier output, and the ids min_tokens masks.
    prompt_ids: list[int]
    earlier_ids: list[int]
    stop_ids: tuple[int, ...]
    # Guided decoding: the matcher, advanced over the earlier output and ``consumed`` of
    # ``output_ids``; None once the constraint is complete (pdserve ends the request there).
    guide: Guide | None = None
    consumed: int = 0

    def request(self) -> SampleRequest:
        index = self.offset + len(self.output_ids)
        allowed = self._allowed()
        if not self.params.processes_logits:
            return SampleRequest(self.params, index, allowed=allowed)
        output = [*self.earlier_ids, *self.output_ids]
        return SampleRequest(self.params, index, self.prompt_ids, output, self.stop_ids, allowed)

    def _allowed(self) -> torch.Tensor | None:
        """The grammar's mask after every token vLLM has produced for the request. A token
        the grammar refuses (its row allowed nothing) is the request's error, which pdserve's
        side raises on the same token (``vllm_engine/request_table.py``) and which must never
        raise inside vLLM's step: the row goes on unconstrained until the request is gone."""
        if self.guide is None:
            return None
        while self.consumed < len(self.output_ids):
            token_id = self.output_ids[self.consumed]
            self.consumed += 1
            try:
                complete = self.guide.accept(token_id)
            except RequestError:
                complete = True
            if complete:
                self.guide = None  # complete (or failed): what vLLM samples next is discarded
                return None
        return self.guide.masks((), 1)[0]


def guide_compiler(vllm_config: VllmConfig) -> GuideCompiler:
    """The process's grammar compiler for vLLM's model (``GuideCompiler.shared``): one per
    rank process, which the rank's ``Compile`` fills (``vllm_engine/rank_runtime.py``) before
    its sampler needs a grammar, and the worker's own when vLLM runs in the worker."""
    model = vllm_config.model_config.model
    eos = CheckpointInfo.from_dir(model).eos_token_ids
    vocab = vllm_config.model_config.get_vocab_size()
    return GuideCompiler.shared(Path(model), vocab, eos)


class PdserveSampler(LogitsProcessor):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self._rows: dict[int, _Row] = {}
        # Structured outputs: the process's compiler for this model, where pdserve's side of
        # the engine compiled each grammar before the request reached vLLM (in this process,
        # or in a rank's, through the rank's Compile).
        self._guides = guide_compiler(vllm_config) if vllm_config is not None else None

    def is_argmax_invariant(self) -> bool:
        return False  # it picks the token itself

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._rows.pop(index, None)
        for index, params, prompt_ids, output_ids in batch_update.added:
            row = _row(params, prompt_ids or [], output_ids, self._guides)
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
        tokens = seeded_choice(logits[rows], requests)
        index = torch.tensor(rows, device=logits.device)
        chosen = torch.full_like(logits[rows], float("-inf"))
        chosen.scatter_(1, tokens[:, None], 0.0)
        logits.index_copy_(0, index, chosen)
        return logits


def _row(
    params: vllm.SamplingParams | None,
    prompt_ids: list[int],
    output_ids: list[int],
    guides: GuideCompiler | None = None,
) -> _Row | None:
    extra = (params.extra_args or {}).get(EXTRA_ARGS_KEY) if params is not None else None
    if extra is None:
        return None
    ours = SamplingParams(
        # Unused here (lengths and stops are pdserve's: engine.request_state), but valid.
        max_tokens=max(1, int(extra["min_tokens"])),
        temperature=extra["temperature"],
        top_p=extra["top_p"],
        top_k=extra["top_k"],
        min_p=extra["min_p"],
        seed=extra["seed"],
        presence_penalty=extra["presence_penalty"],
        frequency_penalty=extra["frequency_penalty"],
        repetition_penalty=extra["repetition_penalty"],
        logit_bias=tuple((int(i), float(b)) for i, b in extra["logit_bias"]) or None,
        min_tokens=extra["min_tokens"],
        bad_words=extra["bad_words"] or None,
    )
    structured = extra.get("structured")
    if ours.greedy and not ours.processes_logits and structured is None:
        return None  # vLLM's argmax is pdserve's greedy
    offset = int(extra["offset"])
    split = len(prompt_ids) - offset
    guide = None
    if structured is not None:
        assert guides is not None, "a guided request reached a processor with no model"
        kind, spec, field = structured
        so = StructuredOutput(StructuredKind(kind), spec, field)
        guide = guides.guide(so, prompt_ids[split:], bool(extra["ignore_eos"]))
    if not ours.processes_logits:
        return _Row(ours, offset, output_ids, [], [], (), guide)
    stop_ids = tuple(int(i) for i in extra["stop_ids"])
    return _Row(ours, offset, output_ids, prompt_ids[:split], prompt_ids[split:], stop_ids, guide)
