"""The OpenAI endpoints' work, between the HTTP shell (``router/openai/app.py``) and the
router's one generate path (``RequestCore.read`` and ``responses``, shared with gRPC: the
same limits, tokenization off the loop, capacity checks, migration and metrics).

A request runs in four steps: parse the body into a ``ParsedRequest`` (``protocol.py``); render
the chat template (in a thread: a template is code, and messages can be megabytes); read each
prompt as the gRPC API reads one (a ``Request``: ``router/request.py``); run the choices
(``choices.py``). A streamed response waits for its first token before answering 200, so
refusals that come from the workers (no room, no worker) still get their HTTP status; after
that, an error is a ``data: {"error": ...}`` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

from router.limits import check_output, prompt_bytes
from router.openai import errors
from router.openai.bad_words import bad_words_ids
from router.openai.chat_template import ChatTemplate
from router.openai.choices import Choice, merged
from router.openai.invalid_parameter import InvalidParameter
from router.openai.prompt_leads import (
    PromptLeads,
    prompt_event,
    response_weight,
    share_prompt_logprobs,
)
from router.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ParsedRequest,
    chat_prompt,
    message_dicts,
    parse_chat,
    parse_completion,
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
from router.openai.sse import DONE, event
from router.openai.tool_parsers import PARSERS, ToolStream, detect_parser
from router.openai.tools import NO_TOOLS, ToolPlan, template_messages, tool_plan
from router.request import Request
from router.request_core import RequestCore, ResourceError
from router.result import Chunk, Final, Result

logger = logging.getLogger(__name__)
T = TypeVar("T")
# Past this (output tokens, logprobs weighing 20 each) a whole body is built off the loop.
_ENCODE_IN_THREAD_TOKENS = 4096


@dataclasses.dataclass(frozen=True)
class Started:
    """A streamed response, begun: its events, and the one call that ends the request on the
    workers whatever happened to the events (``EventStream`` calls it last)."""

    events: AsyncGenerator[bytes, None]
    close: Callable[[], Awaitable[None]]


@dataclasses.dataclass
class Prepared:
    """A request ready to run: its choices and the envelope of its response."""

    parsed: ParsedRequest
    env: Envelope
    choices: list[Choice]
    outputs: list[ChoiceOutput]
    client_id: str
    tools: ToolPlan = NO_TOOLS


class OpenAIServing:
    def __init__(
        self,
        core: RequestCore,
        served_model_name: str,
        template: ChatTemplate | None,
        tool_parser: str | None = None,
    ) -> None:
        """``tool_parser``: how ``auto`` tool calls are read back (None: the template's).
        Raises ValueError naming the parsers there are, for one that is not."""
        if tool_parser is not None and tool_parser not in PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {sorted(PARSERS)}, got {tool_parser!r}"
            )
        self.core = core
        self.served_model_name = served_model_name
        self.template = template
        self.token_text = TokenText(core.tokenizer)
        self.tool_parser = tool_parser or detect_parser(template.source if template else None)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise errors.model_not_found(model, self.served_model_name)

    async def prepare_chat(
        self, body: ChatCompletionRequest, client_id: str, caller: str, start_s: float
    ) -> Prepared:
        self.check_model(body.model)
        if self.template is None:
            raise errors.invalid(
                "this model has no chat_template (tokenizer_config.json or chat_template.jinja):"
                " use /v1/completions",
                "messages",
            )
        tools = tool_plan(body.tools, body.tool_choice, self.tool_parser)
        messages = template_messages(message_dicts(body))
        template = self.template
        add_prompt = body.add_generation_prompt is not False
        # A template is code and messages can be megabytes: in a tokenization slot.
        prompt = await self.core.prompts.in_thread(
            lambda: chat_prompt(template, self.core.tokenizer, messages, add_prompt, tools.tools)
        )
        parsed = parse_chat(body, prompt, self.core.config.limits.max_choices, tools.structured)
        prepared = await self._prepare(
            Kind.CHAT, parsed, client_id, caller, start_s, add_special_tokens=False
        )
        return dataclasses.replace(prepared, tools=tools)

    async def prepare_completion(
        self, body: CompletionRequest, client_id: str, caller: str, start_s: float
    ) -> Prepared:
        self.check_model(body.model)
        parsed = parse_completion(body, self.core.config.limits.max_choices)
        return await self._prepare(Kind.COMPLETION, parsed, client_id, caller, start_s)

    async def _prepare(
        self,
        kind: Kind,
        parsed: ParsedRequest,
        client_id: str,
        caller: str,
        start_s: float,
        add_special_tokens: bool = True,
    ) -> Prepared:
        limits = self.core.config.limits
        sampling = parsed.sampling
        if parsed.bad_words:
            ids = bad_words_ids(list(parsed.bad_words), self.core.tokenizer)
            sampling = dataclasses.replace(sampling, bad_words=ids)
        choices: list[Choice] = []
        outputs: list[ChoiceOutput] = []
        for p, prompt in enumerate(parsed.prompts):
            asked = Request(
                client_id,
                sampling,
                caller,
                start_s,
                prompt.text,
                prompt.token_ids,
                add_special_tokens=add_special_tokens,
            )
            read = await self.core.read(asked)
            params = read.params
            if parsed.fill_context:
                room = max(1, self.core.max_model_len - read.num_prompt_tokens)
                if params.min_tokens > room:
                    raise InvalidParameter(
                        "min_tokens",
                        f"min_tokens ({params.min_tokens}) is more than the {room} tokens the "
                        f"context has left after the prompt ({read.num_prompt_tokens} tokens, "
                        f"max_model_len {self.core.max_model_len})",
                    )
                params = dataclasses.replace(params, max_tokens=room)
            for i in range(parsed.n):
                index = p * parsed.n + i
                seed = parsed.seed + i if parsed.seed is not None else None
                # A prompt's logprobs are computed once, by its first choice (the others copy
                # them, and may take prefix-cache hits: a request that wants them takes none).
                first = i == 0 or params.prompt_logprobs is None
                choice_params = dataclasses.replace(
                    params, seed=seed, prompt_logprobs=params.prompt_logprobs if first else None
                )
                # Each choice is a request of its own on the workers (its own id in logs).
                choice_id = client_id if parsed.num_choices == 1 else f"{client_id}-{index}"
                request = dataclasses.replace(read, client_id=choice_id, params=choice_params)
                choices.append(Choice(index, request))
                prompt_ids = list(read.prompt_token_ids)
                outputs.append(ChoiceOutput(index, p, prompt_ids, prompt_text=prompt.text))
        repeated = prompt_bytes(
            [c.request.num_prompt_tokens for c in choices],
            parsed.echo,
            parsed.logprobs,
            parsed.prompt_logprobs,
        )
        # Bounded before any work: a whole response is held until its last token; what each
        # choice repeats of its prompt is one piece even when streamed.
        generated = [] if parsed.stream else [c.request.params.max_tokens for c in choices]
        try:
            check_output(generated, parsed.logprobs, limits, repeated)
        except ValueError as exc:
            raise ResourceError(str(exc)) from None
        env = Envelope(
            kind,
            f"{kind.id_prefix}{client_id}",
            int(time.time()),
            self.served_model_name,
            parsed.logprobs is not None,
            parsed.return_token_ids,
            echo=parsed.echo,
            prompt_logprobs=parsed.prompt_logprobs is not None,
        )
        return Prepared(parsed, env, choices, outputs, client_id)

    def _stream(self, prepared: Prepared) -> AsyncGenerator[tuple[int, Result], None]:
        return merged(self.core, prepared.choices)

    async def collect(self, prepared: Prepared) -> bytes:
        """A whole (non-streamed) response, as JSON. Raises what the choices raise. A large
        one (many choices, logprobs) is built and encoded off the event loop."""
        async with contextlib.aclosing(self._stream(prepared)) as stream:
            async for index, response in stream:
                _record(prepared.outputs[index], response)
        share_prompt_logprobs(prepared.outputs)

        def encode() -> bytes:
            body = response_body(prepared.env, prepared.outputs, self.token_text, prepared.tools)
            text = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
            return text.encode()

        size = sum(response_weight(prepared.env, c) for c in prepared.outputs)
        return encode() if size < _ENCODE_IN_THREAD_TOKENS else await asyncio.to_thread(encode)

    async def start_stream(self, prepared: Prepared) -> Started:
        """The SSE events, begun: the first response is awaited here, so that a refusal before
        any token raises (an HTTP status) instead of becoming an error event."""
        stream = self._stream(prepared)
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            first = None
        except BaseException:
            await stream.aclose()
            raise
        return Started(self._events(prepared, stream, first), stream.aclose)

    async def _events(
        self,
        prepared: Prepared,
        stream: AsyncGenerator[tuple[int, Result], None],
        first: tuple[int, Result] | None,
    ) -> AsyncGenerator[bytes, None]:
        env, outputs, parsed = prepared.env, prepared.outputs, prepared.parsed
        text = self.token_text
        # OpenAI's rule: with include_usage, every chunk has a usage field (null but the last).
        usage = parsed.include_usage
        opened = [env.kind is Kind.CHAT] * len(outputs)  # chat choices open with the role
        readers = [prepared.tools.stream() for _ in outputs]  # tool calls read out of text
        # The prompt (echo, prompt_logprobs) opens each choice once its logprobs are here: its
        # prompt's first choice computes them (``_prepare``), the others wait for them.
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
            if parsed.include_usage:
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


def new_client_id(header: str | None) -> str:
    """The client's ``X-Request-Id`` (length-checked with the request), or a fresh one."""
    return header if header else uuid.uuid4().hex
