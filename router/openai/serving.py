"""An OpenAI request's response, once ``prepare.py`` made its choices: they run through the
router's one generate path (``RequestCore.responses``, shared with gRPC: capacity checks,
migration, metrics), merged (``choices.py``), and become one JSON body or a stream of SSE
events. A streamed response waits for its first token before answering 200, so refusals that
come from the workers (no room, no worker) still get their HTTP status; after that, an error is
a ``data: {"error": ...}`` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from router.openai import errors
from router.openai.choices import merged
from router.openai.prepare import Prepared
from router.openai.prompt_leads import (
    PromptLeads,
    prompt_event,
    response_weight,
    share_prompt_logprobs,
)
from router.openai.responses import (
    ChoiceOutput,
    Envelope,
    Kind,
    TokenText,
    chunk_body,
    response_body,
    usage_chunk,
)
from router.openai.served_model import ServedModel
from router.openai.sse import DONE, event
from router.openai.tool_parsers import ToolStream
from router.openai.tools import ToolPlan
from router.request_core import RequestCore
from router.result import Chunk, Final, Result

logger = logging.getLogger(__name__)
# Past this (output tokens, logprobs weighing 20 each) a whole body is built off the loop.
_ENCODE_IN_THREAD_TOKENS = 4096


@dataclasses.dataclass(frozen=True)
class Started:
    """A streamed response, begun: its events, and the one call that ends the request on the
    workers whatever happened to the events (``EventStream`` calls it last)."""

    events: AsyncGenerator[bytes, None]
    close: Callable[[], Awaitable[None]]


async def collect(core: RequestCore, served: ServedModel, prepared: Prepared) -> bytes:
    """A whole (non-streamed) response, as JSON. Raises what the choices raise. A large
    one (many choices, logprobs) is built and encoded off the event loop."""
    async with contextlib.aclosing(merged(core, prepared.choices)) as stream:
        async for index, response in stream:
            _record(prepared.outputs[index], response)
    share_prompt_logprobs(prepared.outputs)

    def encode() -> bytes:
        body = response_body(prepared.env, prepared.outputs, served.token_text, prepared.tools)
        text = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        return text.encode()

    size = sum(response_weight(prepared.env, c) for c in prepared.outputs)
    return encode() if size < _ENCODE_IN_THREAD_TOKENS else await asyncio.to_thread(encode)


async def start_stream(core: RequestCore, served: ServedModel, prepared: Prepared) -> Started:
    """The SSE events, begun: the first response is awaited here, so that a refusal before
    any token raises (an HTTP status) instead of becoming an error event."""
    stream = merged(core, prepared.choices)
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        first = None
    except BaseException:
        await stream.aclose()
        raise
    return Started(_events(served, prepared, stream, first), stream.aclose)


async def _events(
    served: ServedModel,
    prepared: Prepared,
    stream: AsyncGenerator[tuple[int, Result], None],
    first: tuple[int, Result] | None,
) -> AsyncGenerator[bytes, None]:
    env, outputs, asked = prepared.env, prepared.outputs, prepared.asked
    text = served.token_text
    # OpenAI's rule: with include_usage, every chunk has a usage field (null but the last).
    usage = asked.include_usage
    opened = [env.kind is Kind.CHAT] * len(outputs)  # chat choices open with the role
    readers = [prepared.tools.stream() for _ in outputs]  # tool calls read out of text
    # The prompt (echo, prompt_logprobs) opens each choice once its logprobs are here: its
    # prompt's first choice computes them (``prepare.prepare``), the others wait for them.
    prompts = PromptLeads(env, outputs)
    try:
        async with contextlib.aclosing(stream):
            if env.kind is Kind.CHAT:
                for c in outputs:
                    body = chunk_body(env, c, "", [], [], text, first=True, include_usage=usage)
                    yield event(body)
            async for index, chunk in prompts.ready(_prepend(first, stream)):
                c = outputs[index]
                _count(c, chunk)
                reader = readers[index]
                if prompts.opens(index):
                    yield await prompt_event(env, c, text, usage)
                if isinstance(chunk, Final):
                    for body in _final_chunks(env, c, reader, prepared.tools, text, usage):
                        yield event(body)
                    continue
                piece = chunk.text if reader is None else reader.feed(chunk.text)
                # Tokens without text yet (a partial UTF-8 character, held back) make a
                # chunk only when the client asked to see tokens.
                wants_tokens = env.logprobs or env.return_token_ids
                if not piece and not (chunk.token_ids and wants_tokens):
                    continue
                opening, opened[index] = not opened[index], True
                body = chunk_body(
                    env,
                    c,
                    piece,
                    chunk.token_ids,
                    chunk.logprobs,
                    text,
                    first=opening,
                    include_usage=usage,
                )
                yield event(body)
        if asked.include_usage:
            yield event(usage_chunk(env, outputs))
    except Exception as exc:
        error = errors.from_exception(exc)
        if error is None:
            logger.exception("request_id=%s failed mid-stream", prepared.client_id)
            error = errors.internal(prepared.client_id)
        yield event(error.body())
    yield DONE


def _final_chunks(
    env: Envelope,
    c: ChoiceOutput,
    reader: ToolStream | None,
    tools: ToolPlan,
    text: TokenText,
    usage: bool,
) -> list[dict[str, Any]]:
    """A choice's last chunks: the held text's content and tool calls (when it had tools),
    then its finish reason."""
    out = []
    finish_reason = c.finish_reason
    if reader is not None:
        rest, calls = reader.finish()
        finish_reason = tools.finish_reason(calls, finish_reason)
        bodies = [call.body(k) for k, call in enumerate(calls)] or None
        if rest or bodies:
            out.append(
                chunk_body(env, c, rest or "", [], [], text, include_usage=usage, tool_calls=bodies)
            )
    out.append(
        chunk_body(env, c, "", [], [], text, finish_reason=finish_reason, include_usage=usage)
    )
    return out


async def _prepend(
    first: tuple[int, Result] | None, stream: AsyncGenerator[tuple[int, Result], None]
) -> AsyncGenerator[tuple[int, Result], None]:
    if first is not None:
        yield first
    async for item in stream:
        yield item


def _record(choice: ChoiceOutput, result: Result) -> None:
    """A non-streamed choice keeps everything: its response is built at the end."""
    if isinstance(result, Chunk):
        choice.prompt_logprobs.extend(result.prompt_logprobs)
        choice.pieces.append(result.text)
        choice.token_ids.extend(result.token_ids)
        choice.logprobs.extend(result.logprobs)
    _count(choice, result)


def _count(choice: ChoiceOutput, result: Result) -> None:
    """A streamed choice keeps counts only: what it sent is gone (a long stream with
    logprobs would otherwise grow without bound)."""
    if isinstance(result, Chunk):
        choice.num_tokens += len(result.token_ids)
    else:
        choice.finish_reason = result.finish_reason
        choice.num_cached_tokens = result.cached_tokens
        choice.ttft_s = result.ttft_s
        choice.phases_s = dict(result.phases)
