"""What the engine reports: per-step updates (for streaming) and whole-request outputs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, TokenLogprobs


@dataclass(frozen=True)
class RequestUpdate:
    """One step's news for one request: the tokens and text it produced in that step."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprobs]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    num_cached_tokens: int = 0
    # Set once for prefill-only requests: the first token is sampled and the blocks are pinned.
    prefilled: bool = False
    # Once, with the first token: the prompt's logprobs (``params.prompt_logprobs``).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # time.monotonic() when the engine first scheduled the request (None: it does not say).
    first_scheduled_s: float | None = None
    # For traces: prompt tokens loaded from the host tier; speculation so far (proposed,
    # kept) for this request.
    num_host_cached_tokens: int = 0
    num_spec_proposed_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    # With finish reason "error": why the request's own parameters ended it (a
    # ``RequestError``'s message; the stream raises it: engine/serving_engine.py).
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # time.perf_counter() when its first and its last token came out of a step (None: no
    # token yet): the decode phase of a batch runs from its latest first token to its last.
    first_token_s: float | None = None
    last_token_s: float | None = None
    # Finish reason "error": why the request's own parameters ended it (engine/request_error.py).
    error: str | None = None

    def apply(self, update: RequestUpdate) -> None:
        if update.new_token_ids:
            self.last_token_s = time.perf_counter()
            if self.first_token_s is None:
                self.first_token_s = self.last_token_s
        self.prompt_logprobs.extend(update.prompt_logprobs)
        self.token_ids.extend(update.new_token_ids)
        self.text += update.new_text
        self.logprobs.extend(update.new_logprobs)
        self.finish_reason = update.finish_reason
        self.num_cached_tokens = update.num_cached_tokens
        self.error = update.error


@dataclass(frozen=True)
class PrefilledRequest:
    """What a decode engine needs to resume a request prefilled elsewhere (besides the KV)."""

    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    params: SamplingParams
    block_ids: list[int]  # on the prefill engine; pinned until free_pinned()
    first_token_logprobs: TokenLogprobs | None = None
    # A continued (migrated) request: the last that many of prompt_token_ids are earlier output.
    num_generated_tokens: int = 0

    @classmethod
    def of_pinned(cls, seq: Sequence, block_ids: list[int]) -> PrefilledRequest:
        """A request pinned at its first token, as a decode engine resumes it: every token but
        the one just sampled is in the blocks (prompt, and a continued request's earlier
        output)."""
        return cls(
            request_id=seq.request_id,
            prompt_token_ids=seq.token_ids[:-1],
            first_token_id=seq.token_ids[-1],
            params=seq.params,
            block_ids=block_ids,
            first_token_logprobs=seq.logprobs[-1] if seq.logprobs else None,
            num_generated_tokens=seq.num_output_tokens - 1,
        )


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int  # waiting to be admitted, or (KV already here) for a seat
    num_running: int
    num_pinned: int
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_preemptions: int
    # Prompt tokens this engine ran through the model (prefix hits and imported KV excluded).
    num_prompt_tokens_computed: int
    num_prefix_hit_tokens: int
    # Requests whose consumer stopped reading: blocks kept, no seat, not scheduled.
    num_paused: int = 0
    num_steps: int = 0  # engine steps that ran the model
    # The host tier: prompt tokens loaded from it (part of num_prefix_hit_tokens), its size
    # and fill, in blocks.
    num_host_hit_tokens: int = 0
    num_host_blocks: int = 0
    num_host_cached_blocks: int = 0
    # Host-tier copies so far: blocks copied out, copied back in, and slots given up (LRU).
    num_host_stored_blocks: int = 0
    num_host_loaded_blocks: int = 0
    num_host_evicted_blocks: int = 0
    # Speculative decoding: guesses verified and kept, and (request, step) verifications;
    # tokens per verifying step = (accepted + verifications) / verifications.
    num_spec_proposed_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_spec_verifications: int = 0
    # Prompt tokens the draft model computed (the target's count stays apart).
    num_draft_prompt_tokens_computed: int = 0
