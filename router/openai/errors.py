"""OpenAI's error shape, ``{"error": {"message", "type", "param", "code"}}``, and the one map
from pdserve's refusals to HTTP statuses (the gRPC frontend's codes, translated):

| pdserve | HTTP |
| --- | --- |
| invalid field (INVALID_ARGUMENT; a ValueError while the request is read) | 400, ``param`` |
| a prompt no worker could ever hold | 400 (retrying cannot help; vLLM answers 400 too) |
| missing or wrong API key | 401 |
| a ``model`` this router does not serve | 404 |
| body over ``--max-request-bytes`` | 413 |
| body not received within ``--request-body-timeout-s`` | 408 |
| a response that could outgrow ``--max-output-bytes`` | 400, naming max_tokens, n, logprobs |
| ``--max-concurrent-requests`` in flight | 429, ``Retry-After`` |
| overloaded (RESOURCE_EXHAUSTED) | 429, ``Retry-After`` |
| flow control (docs/slo.md): queue full, TTFT target missed, TTL over | 429, ``Retry-After`` |
| flow control: no worker in the pool that computes prompts | 503, ``Retry-After`` |
| draining, loading, no worker (UNAVAILABLE) | 503, ``Retry-After`` |
| a worker's PERMISSION_DENIED, FAILED_PRECONDITION, DATA_LOSS | 503, ``Retry-After`` |
| anything else (a ValueError past the request's reading too: a bug) | 500, no internals |

A 500's internals go to the log, with the request id; only its id goes to the client.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import grpc
import pydantic

from engine.sampling_params import InvalidField
from router.openai.protocol import InvalidParameter
from router.prompts import Overloaded
from router.worker_errors import WorkerError

RETRY_AFTER_S = 1


@dataclass
class ApiError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after_s: int | None = None

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s else {}


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, "service_unavailable", code="unavailable", retry_after_s=1)


def unauthorized() -> ApiError:
    return ApiError(
        401,
        "a valid API key is required: Authorization: Bearer <key>",
        "authentication_error",
        code="invalid_api_key",
    )


def model_not_found(model: str, served: str) -> ApiError:
    return ApiError(
        404,
        f"The model {model!r} does not exist: this server serves {served!r}",
        param="model",
        code="model_not_found",
    )


def body_too_slow(timeout_s: int) -> ApiError:
    return ApiError(
        408,
        f"the request body did not arrive within --request-body-timeout-s ({timeout_s})",
        code="request_timeout",
    )


def too_large(num_bytes: int | None, limit: int) -> ApiError:
    size = f"{num_bytes} bytes" if num_bytes is not None else "more bytes"
    return ApiError(
        413,
        f"the request body has {size}, more than --max-request-bytes ({limit})",
        code="request_too_large",
    )


_FIELD = re.compile(r"^([a-z_]+)(\[\d+\])*")
_FIELDS = frozenset(
    [
        "prompt",
        "messages",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "logprobs",
        "n",
        "request_id",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "min_tokens",
        "response_format",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "prompt_logprobs",
        "bad_words",
    ]
)
# Engine and router field names as the OpenAI API spells them.
_API_NAMES = {"prompt_token_ids": "prompt", "request_id": "x-request-id"}


def invalid(message: str, param: str | None = None) -> ApiError:
    """A 400. ``param`` defaults to the field the message starts with (every pdserve refusal
    names its field first)."""
    if param is None:
        match = _FIELD.match(message)
        name = match.group(1) if match else ""
        name = _API_NAMES.get(name, name)
        param = name if name in _FIELDS or name in _API_NAMES.values() else None
    return ApiError(400, message, param=param, code="invalid_parameter")


def from_validation(exc: pydantic.ValidationError) -> ApiError:
    """Pydantic's first complaint, as ``messages[0].content: Input should be ...``."""
    first = exc.errors(include_url=False)[0]
    loc = first.get("loc", ())
    message = str(first.get("msg", "invalid"))
    kind = str(first.get("type", ""))
    if kind.startswith("json"):  # the body is not JSON at all
        return ApiError(400, f"the body is not valid JSON: {message}", param="body")
    if not loc and kind.startswith("model"):
        return ApiError(400, "the body must be a JSON object", param="body")
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    # A union's branches appear in the location; the field is what comes before them.
    param = re.split(r"\.(str|int|list|function-|json-)", path)[0] or None
    if param in _SHAPES:
        message = f"must be {_SHAPES[param]}"
    where = f"{param}: " if param else ""
    return ApiError(400, f"{where}{message}", param=param, code="invalid_type")


# Fields that are unions: pydantic's complaint would name one branch only.
_SHAPES = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of lists of them",
    "stop": "a string or a list of strings",
}


_GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    # The cluster's state, not a bug: no worker could take the request as things are (a
    # decode worker that does not know the prefill worker yet, a worker of another model,
    # KV that failed its digest). The router's log has the worker's words.
    grpc.StatusCode.PERMISSION_DENIED: 503,
    grpc.StatusCode.FAILED_PRECONDITION: 503,
    grpc.StatusCode.DATA_LOSS: 503,
}


def from_exception(exc: BaseException) -> ApiError | None:
    """The client's error for an exception pdserve raises by design; None: a bug (500)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidParameter):
        return invalid(str(exc), exc.param)
    if isinstance(exc, Overloaded):
        if exc.unavailable:
            return ApiError(
                503, str(exc), "service_unavailable", "unavailable", retry_after_s=exc.retry_after_s
            )
        return ApiError(
            429, str(exc), "rate_limit_error", code="overloaded", retry_after_s=exc.retry_after_s
        )
    if isinstance(exc, WorkerError):
        status = _GRPC_TO_HTTP.get(exc.code)
        if status == 400 or exc.never:
            return invalid(exc.message)
        if status == 429:
            return ApiError(
                429,
                "no worker has room for this request now; retry",
                "rate_limit_error",
                code="overloaded",
                retry_after_s=RETRY_AFTER_S,
            )
        if status == 503:
            return unavailable("no worker is available for this request now; retry")
        return None
    return None


def refusal(exc: ValueError) -> ApiError:
    """A refusal of the request's content, raised while it is read and checked (limits,
    sampling, prompts, templates, capacity: every check names its field): 400. Only there
    is a ValueError the client's: past that, one is a bug (``from_exception``: 500)."""
    if isinstance(exc, InvalidParameter):
        return invalid(str(exc), exc.param)
    if isinstance(exc, InvalidField):  # the engine's check of a sampling value
        return invalid(str(exc), exc.field)
    return invalid(str(exc))


def internal(request_id: str) -> ApiError:
    return ApiError(
        500, f"internal error (request id {request_id})", "internal_error", code="internal_error"
    )
