"""The OpenAI API's request bodies (chat and text completions), parsed and checked into one
``ParsedRequest``: which prompts, how many choices, what sampling. Pure: no I/O.

Fields follow OpenAI's API and vLLM's extras (``top_k``, ``min_p``, ``ignore_eos``,
``stop_token_ids``, ``return_token_ids``, ``prompt_logprobs``, the structured-output fields).
Every optional field may be ``null`` (its default), as OpenAI's spec allows. Types are strict
(JSON types as the spec says: ``true`` is not 1, ``"5"`` is not 5). Unknown fields are
ignored, as vLLM and SGLang do; known fields pdserve cannot honour (``suffix``, ``functions``,
``best_of`` other than ``n``) are refused by name rather than silently dropped.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from engine.sampling_params import (
    MAX_INT32,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    InvalidField,
    SamplingParams,
)
from engine.structured_output import StructuredOutput
from engine.tokenizer import Tokenizer
from router.openai.chat_template import ChatTemplate
from router.openai.control_text import check_control_text
from router.openai.flow_fields import SloTargets, flow_fields
from router.openai.invalid_parameter import InvalidParameter
from router.openai.structured import structured_output
from router.request_class import Slo


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool | None = None


class _Sampling(_Body):
    model: str | None = None  # None: the served model (as vLLM)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = Field(default=None, ge=0)  # vLLM's extra
    best_of: int | None = None
    user: str | None = None  # accepted and ignored
    # vLLM's extras.
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    return_token_ids: bool | None = None
    prompt_logprobs: int | None = None  # vLLM's: top-n logprobs of each prompt token
    bad_words: list[str] | None = None  # vLLM's (router/openai/bad_words.py)
    # Output constraints (router/openai/structured.py): OpenAI's, then vLLM's.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    # Flow control (docs/slo.md): vLLM's priority (lower first), OpenAI's service_tier (a
    # request class's name; "auto" and "default": the API key's class), pdserve's targets.
    priority: int | None = None
    service_tier: str | None = None
    slo: SloTargets | None = None


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # Extra fields (tool_calls, tool_call_id, ...) go to the template, as transformers passes them.
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = None  # None: True
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request: text (rendered chat, or a completions string) or token ids."""

    text: str | None = None
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ParsedRequest:
    """What a request asks for. ``sampling`` has no seed: choice i of a seeded request uses
    ``seed + i`` (vLLM v1's rule), so ``n`` choices differ and reproduce; with
    ``fill_context``, its ``max_tokens`` is ``MAX_INT32`` until the serving layer knows the
    prompt's length."""

    prompts: tuple[Prompt, ...]
    n: int
    sampling: SamplingParams
    seed: int | None
    stream: bool
    include_usage: bool
    return_token_ids: bool
    logprobs: int | None  # top logprobs per token (0: the chosen token's only); None: off
    fill_context: bool  # no max_tokens given (chat): generate up to the model's length
    echo: bool = False  # completions: the prompt leads the text (and its logprobs, the list)
    bad_words: tuple[str, ...] = ()  # tokenized where the tokenizer is (the serving layer)
    prompt_logprobs: int | None = None  # vLLM's ``prompt_logprobs`` field, as asked
    priority: int | None = None  # None: its class's
    service_class: str | None = None  # None: its API key's class, else the router's default
    slo: Slo = dataclasses.field(default_factory=Slo)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


def _refuse_unsupported(body: _Sampling) -> None:
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise InvalidParameter("best_of", "best_of is not supported (other than equal to n)")
    if body.stream_options is not None and not body.stream:
        raise InvalidParameter("stream_options", "stream_options needs stream: true")


def _sampling(body: _Sampling, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """Only what was given is set: the engine's defaults apply to the rest, and its own
    validation names each field (``max_tokens`` None: to be filled, ``ParsedRequest``)."""
    given: dict[str, Any] = {n: getattr(body, n) for n in _NUMBERS if getattr(body, n) is not None}
    if isinstance(body.stop, str):
        given["stop"] = (body.stop,)
    elif body.stop:
        given["stop"] = tuple(body.stop)
    if body.stop_token_ids:
        given["stop_token_ids"] = _ids("stop_token_ids", body.stop_token_ids)
    if body.logit_bias:
        given["logit_bias"] = _logit_bias(body.logit_bias)
    if body.prompt_logprobs is not None:
        given["prompt_logprobs"] = body.prompt_logprobs
    constraint = structured_output(
        body.response_format,
        body.structured_outputs,
        body.guided_json,
        body.guided_regex,
        body.guided_choice,
    )
    try:
        return SamplingParams(
            max_tokens=MAX_INT32 if max_tokens is None else max_tokens,
            ignore_eos=bool(body.ignore_eos),
            logprobs=logprobs,
            structured=constraint,
            **given,
        )
    except InvalidField as exc:
        raise InvalidParameter(exc.field, str(exc)) from None


_NUMBERS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
)


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's string keys as token ids (the count, range and vocabulary are checked after,
    naming ``logit_bias`` too)."""
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidParameter(
            "logit_bias", f"logit_bias has {len(bias)} entries, more than {MAX_LOGIT_BIAS}"
        )
    out = {}
    for key, value in bias.items():
        if not key.isdigit() or not 0 <= int(key) < 1 << 32:
            raise InvalidParameter("logit_bias", f"logit_bias key {key[:32]!r} is not a token id")
        out[int(key)] = value
    return out


def _ids(param: str, ids: list[int]) -> tuple[int, ...]:
    """Token ids that fit the wire (the vocabulary is checked later, also naming ``param``)."""
    if any(not 0 <= t < 1 << 32 for t in ids):
        raise InvalidParameter(param, f"{param} holds an id outside [0, 2**32)")
    return tuple(ids)


def _check_seed(seed: int | None, n: int) -> None:
    # Choice i samples with seed + i: every one of those must be a valid seed.
    if seed is not None and not 0 <= seed <= (1 << 63) - n:
        raise InvalidParameter("seed", f"seed must be in [0, 2**63 - n], got {seed}")


def _check_choices(num_prompts: int, n: int, max_choices: int) -> None:
    if num_prompts * n > max_choices:
        raise InvalidParameter(
            "n",
            f"{num_prompts} prompts x n={n} is {num_prompts * n} choices, more than "
            f"--max-choices ({max_choices})",
        )


def _parse(
    body: _Sampling,
    prompts: tuple[Prompt, ...],
    max_tokens: int | None,
    logprobs: int | None,
    max_choices: int,
) -> ParsedRequest:
    _refuse_unsupported(body)
    n = body.n or 1
    _check_choices(len(prompts), n, max_choices)
    _check_seed(body.seed, n)
    _check_logprobs("prompt_logprobs", body.prompt_logprobs)
    sampling = _sampling(body, max_tokens, logprobs)
    options = body.stream_options
    return ParsedRequest(
        prompts=prompts,
        n=n,
        sampling=sampling,
        seed=body.seed,
        stream=bool(body.stream),
        include_usage=options is not None and bool(options.include_usage),
        return_token_ids=bool(body.return_token_ids),
        logprobs=logprobs,
        fill_context=max_tokens is None,
        prompt_logprobs=body.prompt_logprobs,
        bad_words=tuple(body.bad_words or ()),
        **flow_fields(body.priority, body.service_tier, body.slo),
    )


def message_dicts(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the chat template sees them. Text parts of a content list are joined
    with newlines (vLLM's "string" content format); other parts are refused by name."""
    if not body.messages:
        raise InvalidParameter("messages", "messages must not be empty")
    out = []
    for i, message in enumerate(body.messages):
        plain = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            texts = []
            for j, part in enumerate(message.content):
                if part.type != "text" or part.text is None:
                    raise InvalidParameter(
                        f"messages[{i}].content[{j}].type",
                        f"messages[{i}].content[{j}]: only text parts are supported, "
                        f"got type {part.type!r}",
                    )
                texts.append(part.text)
            plain["content"] = "\n".join(texts)
        out.append(plain)
    return out


def chat_prompt(
    template: ChatTemplate,
    tokenizer: Tokenizer | None,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
) -> Prompt:
    """The rendered chat as a prompt. Where a message's content holds a control-token string
    ("<|im_end|>"), that content is tokenized as text and the template's own text as usual,
    so a user cannot end their turn or open another role by typing its marker. A template
    that rewrites contents (so they cannot be located in its output) is refused then. Any
    other client text holding one, and roles the template does not know, are refused before
    rendering (``router/openai/control_text.py``)."""
    check_control_text(tokenizer, template.roles, messages, tools)
    rendered = template.render(messages, add_generation_prompt, tools)
    found = [
        (i, tokenizer.has_special_string(m["content"]))
        for i, m in enumerate(messages)
        if tokenizer is not None and isinstance(m.get("content"), str)
    ]
    marked = [(i, s) for i, s in found if s is not None]
    if tokenizer is None or not marked:
        return Prompt(text=rendered)
    parts = template.render_parts(messages, add_generation_prompt, tools)
    if parts is None:
        i, special = marked[0]
        raise InvalidParameter(
            f"messages[{i}].content",
            f"messages[{i}].content holds the control token {special!r}, and this model's chat "
            "template rewrites message contents, so it cannot be kept as text",
        )
    ids: list[int] = []
    for text, is_content in parts:
        ids += tokenizer.encode_as_text(text) if is_content else tokenizer.encode(text, False)
    return Prompt(token_ids=tuple(ids))


def _check_logprobs(param: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise InvalidParameter(param, f"{param} must be in [0, {MAX_LOGPROBS}], got {value}")


def parse_chat(
    body: ChatCompletionRequest,
    prompt: Prompt,
    max_choices: int,
    tools: StructuredOutput | None = None,
) -> ParsedRequest:
    """``tools``: the constraint ``tool_choice`` puts on the output (router/openai/tools.py)."""
    if body.functions:
        raise InvalidParameter("functions", "functions are deprecated: use tools")
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidParameter("top_logprobs", "top_logprobs needs logprobs: true")
    _check_logprobs("top_logprobs", body.top_logprobs)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens or body.max_tokens
    parsed = _parse(body, (prompt,), max_tokens, logprobs, max_choices)
    if tools is None:
        return parsed
    if parsed.sampling.structured is not None:
        raise InvalidParameter(
            "tool_choice",
            f"tool_choice {body.tool_choice!r} leaves no room for another "
            f"output constraint ({parsed.sampling.structured.field})",
        )
    return dataclasses.replace(
        parsed, sampling=dataclasses.replace(parsed.sampling, structured=tools)
    )


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> tuple[Prompt, ...]:
    if isinstance(prompt, str):
        return (Prompt(text=prompt),)
    if not prompt:
        raise InvalidParameter("prompt", "prompt must not be empty")
    if all(isinstance(p, int) for p in prompt):
        return (Prompt(token_ids=_ids("prompt", prompt)),)  # type: ignore[arg-type]
    out = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            out.append(Prompt(text=p))
        else:
            out.append(Prompt(token_ids=_ids(f"prompt[{i}]", p)))  # type: ignore[arg-type]
    return tuple(out)


def parse_completion(body: CompletionRequest, max_choices: int) -> ParsedRequest:
    if body.suffix:
        raise InvalidParameter("suffix", "suffix is not supported")
    prompts = completion_prompts(body.prompt)
    _check_logprobs("logprobs", body.logprobs)
    # OpenAI's default for text completions is 16 tokens (the engine's default too).
    parsed = _parse(body, prompts, body.max_tokens or 16, body.logprobs, max_choices)
    if body.echo and body.logprobs is not None:  # the prompt's entries lead the list
        wanted = max(body.logprobs, body.prompt_logprobs or 0)
        sampling = dataclasses.replace(parsed.sampling, prompt_logprobs=wanted)
        parsed = dataclasses.replace(parsed, sampling=sampling)
    return dataclasses.replace(parsed, echo=bool(body.echo))
