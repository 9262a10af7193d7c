"""What a request must pass to enter an engine, and the ``Sequence`` it becomes there (of the
engine's own kind: the native engine's ``PagedSequence``, the vLLM engine's plain one): one rule
for every engine behind the serving contract (the native ``LLMEngine``; the vLLM engine's
request table, which keeps pdserve's side of each request).

Everything is checked before any work, and each refusal names the field: the prompt (its ids
in the vocabulary, its length), the sampling parameters against this model (every id they
carry, bans that could leave no token, stop strings without a tokenizer, logprobs past the
vocabulary: ``engine/prompt.py``), a continuation (migration) that could still produce a
token, and a guided request's grammar, compiled, replayed over a continuation's earlier output
and checked to allow a first token (``GuideCompiler.guide_for``: slow on a cache miss, so an
async engine makes the matcher off the event loop and passes it in).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from engine.guide import Guide, GuideCompiler
from engine.prompt import validate_prompt, validate_sampling, validate_token_ids
from engine.sampling_params import SamplingParams, check_continuation
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer

S = TypeVar("S", bound=Sequence)


@dataclass(frozen=True)
class Intake:
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    tokenizer: Tokenizer | None
    guides: GuideCompiler

    def sequence(
        self,
        kind: type[S],
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        num_generated: int = 0,
        *,
        guide: Guide | None = None,
    ) -> S:
        """The request as a ``kind`` of this engine: ``prompt`` (text or ids) whose last
        ``num_generated`` ids are earlier output (a continuation). ``guide``: the matcher
        ``prepare_guide`` made; made here when None. Raises ValueError naming the field."""
        self.check_params(params)
        token_ids = self.validate_prompt(prompt)
        if num_generated:
            check_continuation(len(token_ids), num_generated, params, self.max_model_len)
        own_prompt = token_ids[: len(token_ids) - num_generated]
        seq = kind(request_id, own_prompt, params, token_ids)
        if params.structured is not None:
            seq.guide = guide or self.prepare_guide(params, seq.output_token_ids)
        return seq

    def prepare_guide(self, params: SamplingParams, output_ids: list[int]) -> Guide:
        """A guided request's matcher past ``output_ids`` (``GuideCompiler.guide_for``);
        touches no engine state, so it runs in a thread before intake."""
        return self.guides.guide_for(params, output_ids)

    def check_params(self, params: SamplingParams) -> None:
        validate_sampling(params, self.vocab_size, self.eos_token_ids)
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has no tokenizer.json")
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(f"logprobs must be <= vocab_size {self.vocab_size}")

    def validate_prompt(self, prompt: str | list[int]) -> list[int]:
        return validate_prompt(prompt, self.tokenizer, self.vocab_size, self.max_model_len)

    def validate_token_ids(self, token_ids: list[int], name: str) -> None:
        validate_token_ids(token_ids, self.vocab_size, name)
