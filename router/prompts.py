"""A public request's prompt and sampling, validated, as token ids: the size checks first
(``router/limits.py``), then tokenization in a thread (the tokenizer releases the GIL, so the
event loop and every other stream keep moving), at most ``max_concurrent_tokenizations`` at
once and ``max_queued_tokenizations`` waiting; past that, RESOURCE_EXHAUSTED."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import TypeVar

from engine.prompt import validate_prompt, validate_sampling
from engine.threads import finish_in_thread
from engine.tokenizer import Tokenizer
from pdserve.common import metrics
from router.limits import RequestLimits, check_request
from router.request import Request

T = TypeVar("T")


class Overloaded(Exception):
    """Refused for load, not for its content: RESOURCE_EXHAUSTED (HTTP 429), or UNAVAILABLE
    (503) when no worker could take it; either way with the seconds after which a retry
    may succeed (``Retry-After``)."""

    def __init__(self, message: str, retry_after_s: int = 1, unavailable: bool = False) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.unavailable = unavailable


class PromptReader:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        limits: RequestLimits,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.limits = limits
        self.eos_token_ids = eos_token_ids
        self._slots = asyncio.Semaphore(limits.max_concurrent_tokenizations)
        self._queued = 0

    async def read(self, request: Request, max_model_len: int) -> Request:
        """``request`` with its prompt as validated ids. Raises ValueError (INVALID_ARGUMENT,
        naming the field) or ``Overloaded``."""
        check_request(request, self.limits, max_model_len)
        has_text, has_ids = request.prompt is not None, len(request.prompt_token_ids) > 0
        if has_text == has_ids:
            raise ValueError("set exactly one of prompt and prompt_token_ids")
        validate_sampling(request.params, self.vocab_size, self.eos_token_ids)
        if has_ids:
            ids = validate_prompt(
                list(request.prompt_token_ids), None, self.vocab_size, max_model_len
            )
            return dataclasses.replace(request, prompt_token_ids=tuple(ids))
        text = request.prompt
        assert text is not None
        if self.tokenizer is None or not text:
            # validate_prompt names the problem (no tokenizer, empty prompt).
            validate_prompt(text, self.tokenizer, self.vocab_size, 1)
        tokenizer, vocab_size = self.tokenizer, self.vocab_size
        assert tokenizer is not None

        def tokenize() -> list[int]:
            # Checked in the thread too: the ids of a 2 MiB prompt take a while to scan.
            ids = tokenizer.encode(text, request.add_special_tokens)
            return validate_prompt(ids, None, vocab_size, max_model_len, "prompt")

        ids = await self.in_thread(tokenize)
        return dataclasses.replace(request, prompt_token_ids=tuple(ids))

    async def in_thread(self, work: Callable[[], T]) -> T:
        """``work`` (a tokenization, a chat template's rendering) in a thread, at most
        ``max_concurrent_tokenizations`` at once and ``max_queued_tokenizations`` waiting;
        past that, ``Overloaded``."""
        if self._queued >= self.limits.max_queued_tokenizations:
            raise Overloaded(
                f"{self._queued} prompts are waiting for tokenization, the limit "
                f"(--max-queued-tokenizations {self.limits.max_queued_tokenizations}); retry"
            )
        self._queued += 1
        try:
            await self._slots.acquire()
        finally:
            self._queued -= 1
        metrics.TOKENIZATIONS.inc()
        metrics.TOKENIZATIONS_IN_FLIGHT.inc()
        try:
            # A cancelled request still waits for its thread: the slot bounds real work.
            return await finish_in_thread(work)
        finally:
            metrics.TOKENIZATIONS_IN_FLIGHT.dec()
            self._slots.release()
