"""Turns a request's token ids into client chunks: incremental text, usage, timings.

It is also the router's record of what the client has: ``output_token_ids`` are the tokens
relayed so far, the ones a migrated request continues from. The detokenizer and its stop-string
state live here too, so they carry over a migration unchanged.
"""

from __future__ import annotations

import time

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from pdserve.common import metrics
from pdserve.common.convert import finish_reason_from_proto
from pdserve.v1 import common_pb2, router_pb2


class OutputStream:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...],
        start_s: float,
    ) -> None:
        self.params = params
        self._eos_token_ids = eos_token_ids
        self._detokenizer = (
            IncrementalDetokenizer(tokenizer, prompt_token_ids, params.stop_strings)
            if tokenizer is not None
            else None
        )
        self.num_prompt_tokens = len(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.start_s = start_s
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self._migrated_at_s: float | None = None  # last token before a migration

    def chunk(
        self,
        token_ids: list[int],
        logprobs: list[common_pb2.TokenLogprobs],
        prompt_logprobs: list[common_pb2.TokenLogprobs] | None = None,
    ) -> router_pb2.GenerateResponse:
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
        return router_pb2.GenerateResponse(
            chunk=router_pb2.TokenChunk(
                token_ids=token_ids, text=text, logprobs=logprobs, prompt_logprobs=prompt_logprobs
            )
        )

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
        finish_reason: common_pb2.FinishReason.ValueType,
        num_cached_tokens: int,
        prefill_s: float,
        transfer_s: float,
        num_migrations: int = 0,
        phases: dict[str, float] | None = None,
    ) -> router_pb2.GenerateResponse:
        """The final message; ``phases``: seconds by phase (``router/phases.py``)."""
        if (
            self._detokenizer is not None
            and self._detokenizer.stopped
            and finish_reason_from_proto(finish_reason) == "length"
        ):
            # The stop string completed inside the held-back tail (the engine does the same).
            finish_reason = common_pb2.FINISH_REASON_STOP
        return router_pb2.GenerateResponse(
            final=router_pb2.GenerateFinal(
                request_id=request_id,
                finish_reason=finish_reason,
                usage=router_pb2.Usage(
                    prompt_tokens=self.num_prompt_tokens,
                    completion_tokens=self.num_output_tokens,
                    cached_tokens=num_cached_tokens,
                ),
                timings=router_pb2.Timings(
                    ttft_s=self.ttft_s,
                    mean_tpot_s=self.mean_tpot_s,
                    prefill_s=prefill_s,
                    transfer_s=transfer_s,
                    phases=phases,
                ),
                num_migrations=num_migrations,
            )
        )
