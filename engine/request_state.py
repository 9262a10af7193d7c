"""One request's output on its way to its consumer: tokens appended one at a time, detokenized,
checked against every stop condition, and flushed as ``RequestUpdate``s.

Every engine behind the serving contract uses it (the native ``LLMEngine``, and the vLLM engine
for the tokens vLLM samples), so stop tokens, stop strings, ``max_tokens``, ``max_model_len``
and the text of an update follow one rule whatever produced the tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import RequestUpdate
from engine.request_error import OutsideGrammar, RequestError
from engine.sequence import Sequence, SequenceStatus, TokenLogprobs
from engine.token_bans import banned_ids, bans_anything, min_tokens_ids, no_token_message
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# The engine's own kind of sequence (the native engine's ``PagedSequence``).
S = TypeVar("S", bound=Sequence)


@dataclass(eq=False)
class RequestState(Generic[S]):
    seq: S
    detokenizer: IncrementalDetokenizer | None
    reported_cached: bool = False
    reported_prompt_logprobs: bool = False
    pending_ids: list[int] = field(default_factory=list)
    pending_text: str = ""
    pending_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Why the request's own parameters ended it (a ``RequestError``'s message): set by the
    # engine before it finishes the request with FINISHED_ERROR; its last update carries it.
    error: str | None = None

    @classmethod
    def create(
        cls, seq: S, tokenizer: Tokenizer | None, eos_token_ids: tuple[int, ...]
    ) -> RequestState[S]:
        detokenizer = (
            IncrementalDetokenizer.for_sequence(tokenizer, seq, eos_token_ids)
            if tokenizer is not None
            else None
        )
        return cls(seq, detokenizer)

    def append(
        self,
        token_id: int,
        logprobs: TokenLogprobs | None,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
    ) -> SequenceStatus | None:
        """Appends one token; returns the status it ends the request with, or None. Raises
        ``RequestError``, appending nothing, for a token the request's own parameters rule out
        (``check``)."""
        seq = self.seq
        # A complete structured output ends the request as a stop does.
        complete = self.check(token_id, eos_token_ids)
        seq.token_ids.append(token_id)
        self.pending_ids.append(token_id)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
            self.pending_logprobs.append(logprobs)
        stop_token = seq.params.is_stop_token(token_id, eos_token_ids)
        stop_string = False
        # A stop token ends the request but, as in vLLM, its text is not part of the output.
        if self.detokenizer is not None and not stop_token:
            text, stop_string = self.detokenizer.add_token(token_id)
            self.pending_text += text
        if stop_token or stop_string or complete:
            return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def check(self, token_id: int, eos_token_ids: tuple[int, ...]) -> bool:
        """Advances the grammar (True: the output is complete) after checking the token
        against the request's bans (``engine/token_bans.py``). A sampler gives a banned token,
        or one outside the grammar, only from a row that allowed nothing: ``RequestError``
        naming the fields that ruled every token out (or the grammar's own failure)."""
        seq = self.seq
        params, index = seq.params, seq.num_output_tokens
        bans = bans_anything(params, index)
        if bans:
            stop_ids = min_tokens_ids(params, eos_token_ids)
            if token_id in banned_ids(params, seq.output_token_ids, stop_ids):
                raise RequestError(no_token_message(params, index))
        if seq.guide is None:
            return False
        try:
            return seq.guide.accept(token_id)
        except OutsideGrammar:
            if bans:
                raise RequestError(no_token_message(params, index)) from None
            raise

    def fail(self, message: str) -> SequenceStatus:
        """The request's own parameters end it (a ``RequestError``): what this step gave it
        is dropped, its last update will carry ``message``. Returns the status to finish it
        with (every engine then finishes it as it finishes any request)."""
        logger.warning("request_id=%s failed: %s", self.seq.request_id, message)
        self.error = message
        self.pending_ids, self.pending_text, self.pending_logprobs = [], "", []
        return SequenceStatus.FINISHED_ERROR

    def finish(self, status: SequenceStatus) -> SequenceStatus:
        """Ends the request with ``status``: the detokenizer's held-back text is pending, and a
        stop string completed inside it turns a length finish into a stop."""
        self.seq.status = status
        if self.detokenizer is not None:
            self.pending_text += self.detokenizer.finish()
            if self.detokenizer.stopped and status is SequenceStatus.FINISHED_LENGTH:
                status = self.seq.status = SequenceStatus.FINISHED_STOPPED
        return status

    def flush(self, finish_reason: str | None, prefilled: bool = False) -> RequestUpdate:
        """What was appended since the last flush, as one update (the first with a token
        carries the prompt's logprobs, when they were wanted)."""
        prompt_logprobs = []
        if self.pending_ids and not self.reported_prompt_logprobs:
            prompt_logprobs, self.reported_prompt_logprobs = self.seq.prompt_logprobs, True
        update = RequestUpdate(
            request_id=self.seq.request_id,
            new_token_ids=self.pending_ids,
            new_text=self.pending_text,
            new_logprobs=self.pending_logprobs,
            finish_reason=finish_reason,
            num_cached_tokens=max(self.seq.num_cached_tokens, 0),
            prefilled=prefilled,
            prompt_logprobs=prompt_logprobs,
            first_scheduled_s=self.seq.first_scheduled_s,
            num_host_cached_tokens=self.seq.num_host_cached_tokens,
            num_spec_proposed_tokens=self.seq.num_spec_proposed_tokens,
            num_spec_accepted_tokens=self.seq.num_spec_accepted_tokens,
            error=self.error if finish_reason is not None else None,
        )
        self.pending_ids, self.pending_text, self.pending_logprobs = [], "", []
        self.reported_cached = True
        return update
