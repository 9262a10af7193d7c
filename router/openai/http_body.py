"""A request's body at the HTTP edge: counted as it arrives and refused (413) past
``--max-request-bytes`` before any parsing, or (408) when it has not all arrived in time; then
parsed by pydantic (strict types, bounded nesting, no Python dicts), off the event loop when
large."""

from __future__ import annotations

import asyncio
from typing import TypeVar

import pydantic
from fastapi import Request

from router.limits import RequestLimits
from router.openai import errors

_PARSE_IN_THREAD_BYTES = 64 << 10
Body = TypeVar("Body", bound=pydantic.BaseModel)


async def read_body(request: Request, limit: int, timeout_s: int) -> bytes:
    """The body, refused past ``limit`` bytes (by its Content-Length before reading, else
    while it arrives, never buffering more than the limit) or when it has not all arrived
    within ``timeout_s`` (a trickled body would hold its request, and a drain, for ever)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise errors.too_large(int(declared), limit)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise errors.too_large(None, limit)
                chunks.append(chunk)
    except TimeoutError:
        raise errors.body_too_slow(timeout_s) from None
    return b"".join(chunks)


async def read_json(request: Request, kind: type[Body], limits: RequestLimits) -> Body:
    """The body as ``kind``. Raises ``ApiError`` (413, 408, or 400 naming the field)."""
    data = await read_body(request, limits.max_request_bytes, limits.request_body_timeout_s)
    if len(data) < _PARSE_IN_THREAD_BYTES:
        return _parse(kind, data)
    return await asyncio.to_thread(_parse, kind, data)


def _parse(kind: type[Body], data: bytes) -> Body:
    try:
        return kind.model_validate_json(data)
    except pydantic.ValidationError as exc:
        raise errors.from_validation(exc) from None
