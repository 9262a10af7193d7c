"""Turns a request's token ids into its results (``router/result.py``): incremental text, usage,
timings.

It is also the router's record of what the client has: ``output_token_ids`` are the tokens
relayed so far, the ones a migrated request continues from. The detokenizer and its stop-string
state live here too, so they carry over a migration unchanged.
"""

from __future__ import annotations

import time

from engine.detokenizer import IncrementalDetokenizer
from engine.sequence import TokenLogprobs
from engine.tokenizer import Tokenizer
from pdserve.common import metrics
from router.request import Request
from router.result import Chunk, Final


class OutputStream:
    def __init__(
        self, tokenizer: Tokenizer | None, request: Request, eos_token_ids: tuple[int, ...]
    ) -> None:
        self.params = params = request.params
        self._eos_token_ids = eos_token_ids
        self._detokenizer = (
            IncrementalDetokenizer(tokenizer, request.prompt_token_ids, params.stop_strings)
            if tokenizer is not None
            else None
        )
        self.num_prompt_tokens = request.num_prompt_tokens
        self.output_token_ids: list[int] = []
        self.start_s = request.start_s
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self._migrated_at_s: float | None = None  # last token before a migration

    def chunk(
        self,
        token_ids: list[int],
        logprobs: list[TokenLogprobs],
        prompt_logprobs: list[TokenLogprobs] | None = None,
    ) -> Chunk:
        """``prompt_logprobs``: the worker's, with the first token (the client's prompt)."""
        text = ""
        for token_id in token_ids:
            # As in the engine: a stop token ends the request and contributes no text.
            if self._detokenizer is not None and not self.params.is_stop_token(
                token_id, self._eos_token_ids
            ):
                delta, _ = self._detokenizer.add_token(token_id)
                text += delta
        now = time.perf_counter()
        if token_ids:
            self.first_token_s = self.first_token_s or now
            self.last_token_s = now
            if self._migrated_at_s is not None:
                metrics.MIGRATION_ADDED_S.observe(now - self._migrated_at_s)
                self._migrated_at_s = None
        self.output_token_ids.extend(token_ids)
        return Chunk(token_ids, text, logprobs, prompt_logprobs or [])

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def stopped(self) -> bool:
        """A stop string completed in the text relayed so far."""
        return self._detokenizer is not None and self._detokenizer.stopped

    def migrating(self) -> None:
        """The stream broke; the next token's gap is what the migration added."""
        self._migrated_at_s = self.last_token_s or self.start_s

    def tail(self) -> str:
        """Text held back for stop-string matching, released at the end."""
        return self._detokenizer.finish() if self._detokenizer is not None else ""

    @property
    def ttft_s(self) -> float:
        return (self.first_token_s or time.perf_counter()) - self.start_s

    @property
    def mean_tpot_s(self) -> float:
        if self.first_token_s is None or self.last_token_s is None or self.num_output_tokens < 2:
            return 0.0
        return (self.last_token_s - self.first_token_s) / (self.num_output_tokens - 1)

    def final(
        self,
        request_id: str,
        finish_reason: str,
        num_cached_tokens: int,
        prefill_s: float,
        transfer_s: float,
        num_migrations: int = 0,
        phases: dict[str, float] | None = None,
    ) -> Final:
        """The final result; ``phases``: seconds by phase (``router/phases.py``)."""
        if self.stopped and finish_reason == "length":
            # The stop string completed inside the held-back tail (the engine does the same).
            finish_reason = "stop"
        return Final(
            request_id=request_id,
            finish_reason=finish_reason,
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=self.num_output_tokens,
            cached_tokens=num_cached_tokens,
            ttft_s=self.ttft_s,
            mean_tpot_s=self.mean_tpot_s,
            prefill_s=prefill_s,
            transfer_s=transfer_s,
            num_migrations=num_migrations,
            phases=phases or {},
        )
