"""What one public request may carry, checked before any work (pure: no I/O, exact tests).

Every check is a byte or count comparison, so a hostile request is refused in microseconds, and
never after a tokenization, a vocabulary scan or a stop-list compile it could have made slow.
Each refusal names the field and the limit (the flag that sets it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from engine.config import DOC
from router.request import Request


def _limit(default: int, doc: str) -> Any:
    return field(default=default, metadata={DOC: doc})


@dataclass(frozen=True)
class RequestLimits:
    max_request_bytes: int = _limit(4 << 20, "a whole request message (gRPC refuses larger ones)")
    max_prompt_bytes: int = _limit(2 << 20, "UTF-8 bytes of a text prompt")
    max_stop_strings: int = _limit(64, "stop strings of one request")
    max_stop_string_bytes: int = _limit(256, "UTF-8 bytes of each stop string")
    max_stop_token_ids: int = _limit(256, "stop token ids of one request")
    max_request_id_bytes: int = _limit(128, "bytes of a client's request id")
    max_concurrent_tokenizations: int = _limit(4, "tokenizations off the event loop at once")
    max_queued_tokenizations: int = _limit(
        64, "requests waiting for a tokenization slot: past this, refused"
    )
    max_choices: int = _limit(64, "OpenAI API: prompts x n of one request")
    # Estimated before any work from choices x max_tokens x (a token, and its top logprobs): a
    # non-streamed response is held until its last token.
    max_output_bytes: int = _limit(256 << 20, "what a whole response may come to, in bytes")
    max_concurrent_requests: int = _limit(4096, "public requests in flight: past this, 429")
    request_body_timeout_s: int = _limit(30, "seconds an HTTP body has to arrive (else 408)")
    # Complete within this long of the connection's start or, on a kept-alive connection, of
    # its first byte (else 408: a silent connection too).
    max_header_bytes: int = _limit(
        64 << 10, "bytes of an HTTP request's head (request line + headers; else 431)"
    )
    request_header_timeout_s: int = _limit(10, "seconds an HTTP request's head has to arrive")
    # Silent, trickling, or kept alive between requests (router/openai).
    max_idle_connections: int = _limit(
        1024, "HTTP connections waiting for a request head: past this, the oldest is closed"
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"{f.name} must be >= 1, got {getattr(self, f.name)}")
        if self.max_prompt_bytes > self.max_request_bytes:
            raise ValueError(
                f"max_prompt_bytes ({self.max_prompt_bytes}) must be <= max_request_bytes "
                f"({self.max_request_bytes})"
            )


# What one output token may weigh in a whole response (its id, text and JSON), one logprob
# entry (token text, id, value, JSON), and one of vLLM's prompt_logprobs entries (an id key, a
# logprob, a rank, the decoded token): generous upper estimates, not measurements.
OUTPUT_TOKEN_BYTES = 24
LOGPROB_BYTES = 48
PROMPT_LOGPROB_BYTES = 80


def output_bytes(max_tokens: list[int], top_logprobs: int | None) -> int:
    """The estimated size of a whole response whose choices generate up to ``max_tokens``
    each, with ``top_logprobs`` per token (None: no logprobs; 0: the chosen token's only)."""
    return sum(max_tokens) * _token_bytes(top_logprobs)


def prompt_bytes(
    num_prompt_tokens: list[int],
    echo: bool,
    top_logprobs: int | None,
    prompt_logprobs: int | None,
) -> int:
    """The estimated size of what each choice repeats of its prompt: ``echo`` (its text and,
    with logprobs, a logprobs entry per prompt token) and vLLM's ``prompt_logprobs`` (the
    prompt token's and the top-n per position). Every choice carries its own copy."""
    per_token = _token_bytes(top_logprobs) if echo else 0
    if prompt_logprobs is not None:
        per_token += PROMPT_LOGPROB_BYTES * (1 + prompt_logprobs)
    return sum(num_prompt_tokens) * per_token


def _token_bytes(top_logprobs: int | None) -> int:
    per_token = OUTPUT_TOKEN_BYTES
    if top_logprobs is not None:
        per_token += LOGPROB_BYTES * (1 + top_logprobs)
    return per_token


def check_output(
    max_tokens: list[int],
    top_logprobs: int | None,
    limits: RequestLimits,
    prompt: int = 0,
) -> None:
    """Raises ValueError (a ``ResourceError`` where raised by the core) naming the fields
    and ``--max-output-bytes`` when the response could outgrow it: choices of up to
    ``max_tokens`` each (none: a streamed response, which is not held whole), plus
    ``prompt`` (``prompt_bytes``: the prompt each choice repeats, held whole in any case)."""
    estimate = output_bytes(max_tokens, top_logprobs) + prompt
    if estimate <= limits.max_output_bytes:
        return
    budget = f"more than --max-output-bytes ({limits.max_output_bytes})"
    if not max_tokens:
        raise ValueError(
            f"the prompt repeated by echo or prompt_logprobs in each choice could come to "
            f"{estimate} bytes, {budget}: lower n, logprobs or prompt_logprobs"
        )
    logprobs = f" with {top_logprobs} top logprobs each" if top_logprobs is not None else ""
    repeated = f" and the prompt each repeats ({prompt} bytes)" if prompt else ""
    raise ValueError(
        f"{len(max_tokens)} choice(s) of up to {max(max_tokens)} tokens{logprobs}{repeated} "
        f"could come to {estimate} bytes, {budget}: lower max_tokens, n, logprobs or "
        "prompt_logprobs"
    )


def check_request_id(request_id: str) -> None:
    """A client's request id goes into log lines (``request_id=...``) and worker ids: a
    newline, any control character or a space in it would forge or split log lines. Raises
    ValueError naming the field and the character."""
    bad = next((c for c in request_id if c.isspace() or not c.isprintable()), None)
    if bad is not None:
        raise ValueError(f"request_id may not hold {bad!r} (whitespace or a control character)")


def _over(field: str, what: str, value: int, limit_name: str, limit: int) -> str:
    flag = "--" + limit_name.replace("_", "-")
    return f"{field} has {value} {what}, more than {flag} ({limit})"


def check_request(request: Request, limits: RequestLimits, max_model_len: int) -> None:
    """Raises ValueError naming the field and the limit. Counts and bytes only."""
    params = request.params
    check_sizes(
        request.client_id,
        request.prompt,
        len(request.prompt_token_ids),
        params.stop_strings,
        len(params.stop_ids),
        limits,
        max_model_len,
    )


def check_sizes(
    request_id: str,
    prompt: str | None,
    num_prompt_ids: int,
    stops: Sequence[str],
    num_stop_ids: int,
    limits: RequestLimits,
    max_model_len: int,
) -> None:
    """``check_request`` on a request's parts as a frontend received them (the gRPC one checks
    the message before converting a byte of it). Raises ValueError naming the field."""
    request_id_bytes = len(request_id.encode())
    if request_id_bytes > limits.max_request_id_bytes:
        name = "max_request_id_bytes"
        raise ValueError(
            _over("request_id", "bytes", request_id_bytes, name, limits.max_request_id_bytes)
        )
    check_request_id(request_id)
    if prompt is not None:
        prompt_bytes = len(prompt.encode())
        if prompt_bytes > limits.max_prompt_bytes:
            limit = limits.max_prompt_bytes
            raise ValueError(_over("prompt", "bytes", prompt_bytes, "max_prompt_bytes", limit))
    if max_model_len and num_prompt_ids > max_model_len:
        raise ValueError(
            f"prompt_token_ids has {num_prompt_ids} tokens, more than max_model_len {max_model_len}"
        )
    if len(stops) > limits.max_stop_strings:
        name, limit = "max_stop_strings", limits.max_stop_strings
        raise ValueError(_over("stop", "strings", len(stops), name, limit))
    for i, stop in enumerate(stops):
        stop_bytes = len(stop.encode())
        if stop_bytes > limits.max_stop_string_bytes:
            name, limit = "max_stop_string_bytes", limits.max_stop_string_bytes
            raise ValueError(_over(f"stop[{i}]", "bytes", stop_bytes, name, limit))
    if num_stop_ids > limits.max_stop_token_ids:
        name, limit = "max_stop_token_ids", limits.max_stop_token_ids
        raise ValueError(_over("stop_token_ids", "ids", num_stop_ids, name, limit))
