"""The OpenAI API's response bodies: chat completions (``chat.completion`` and its
``chat.completion.chunk`` stream) and text completions (``text_completion``), with usage,
logprobs in each endpoint's format, and vLLM's ``return_token_ids`` fields. Pure: no I/O.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.sequence import TokenLogprobs
from engine.tokenizer import Tokenizer
from router.openai.tools import NO_TOOLS, ToolMode, ToolPlan


class Kind(enum.Enum):
    CHAT = "chat"
    COMPLETION = "completion"

    @property
    def object(self) -> str:
        return "chat.completion" if self is Kind.CHAT else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self is Kind.CHAT else "text_completion"

    @property
    def id_prefix(self) -> str:
        return "chatcmpl-" if self is Kind.CHAT else "cmpl-"


class TokenText:
    """A token's own text (for logprobs), decoded alone and remembered: at most one entry per
    vocabulary id. A token that is part of a UTF-8 character decodes to U+FFFD, as in vLLM."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text


@dataclass
class ChoiceOutput:
    """One choice as it accumulates: a non-streamed response's whole text, tokens and
    logprobs; a streamed one's counts only (what it sent is not kept)."""

    index: int
    prompt_index: int
    prompt_token_ids: list[int]
    # Text as it arrives, joined once at the end: appending to one string is quadratic.
    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    num_tokens: int = 0  # generated so far (streamed or not)
    text_offset: int = 0  # completions logprobs: where the next token's text starts
    prompt_text: str | None = None  # as the client sent it (None: token ids)
    # Prompt token i + 1's logprobs at i (``prompt_logprobs``, or ``echo`` with logprobs).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # From the final message: the router's TTFT and where the time went (router/phases.py).
    ttft_s: float = 0.0
    phases_s: dict[str, float] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def total_usage(choices: Sequence[ChoiceOutput]) -> dict[str, Any]:
    """Each prompt counts once (n choices share it), every choice's output counts."""
    prompts: dict[int, ChoiceOutput] = {}
    for c in choices:
        prompts.setdefault(c.prompt_index, c)
    total = usage(
        sum(len(c.prompt_token_ids) for c in prompts.values()),
        sum(c.num_tokens for c in choices),
        sum(c.num_cached_tokens for c in prompts.values()),
    )
    # pdserve's extension: each choice's TTFT and seconds by phase (docs/observability.md).
    total["timings"] = [
        {"index": c.index, "ttft_s": c.ttft_s, "phases_s": c.phases_s} for c in choices
    ]
    return total


# What a non-finite logprob is written as (vLLM's clamp): JSON has no -Infinity or NaN, and
# strict parsers (JavaScript's, Go's, Rust's) refuse them.
LOGPROB_FLOOR = -9999.0


def finite(logprob: float) -> float:
    """``logprob`` as strict JSON can carry it: -inf (and NaN) at ``LOGPROB_FLOOR``, +inf at
    0 (no logprob exceeds it). Every logprob a body or event holds passes through this."""
    if math.isfinite(logprob):
        return logprob
    return 0.0 if logprob > 0 else LOGPROB_FLOOR


def _top(entry: TokenLogprobs, text: TokenText) -> list[tuple[str, float]]:
    pairs = zip(entry.top_token_ids, entry.top_logprobs, strict=False)
    return [(text(t), finite(lp)) for t, lp in pairs]


def chat_logprobs(entries: Sequence[TokenLogprobs], text: TokenText) -> dict[str, Any]:
    def one(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {
                **one(text(e.token_id), finite(e.logprob)),
                "top_logprobs": [one(t, lp) for t, lp in _top(e, text)],
            }
            for e in entries
        ]
    }


def completion_logprobs(
    entries: Sequence[TokenLogprobs], text: TokenText, choice: ChoiceOutput
) -> dict[str, Any]:
    """The legacy format: parallel lists, offsets into the choice's text (advanced here)."""
    tokens, offsets = [], []
    for e in entries:
        token = text(e.token_id)
        tokens.append(token)
        offsets.append(choice.text_offset)
        choice.text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [finite(e.logprob) for e in entries],
        "top_logprobs": [dict(_top(e, text)) for e in entries],
        "text_offset": offsets,
    }


def echo_text(choice: ChoiceOutput, text: TokenText) -> str:
    if choice.prompt_text is not None:
        return choice.prompt_text
    tokenizer = text.tokenizer
    if tokenizer is None:
        return "".join(text(t) for t in choice.prompt_token_ids)
    return tokenizer.decode(choice.prompt_token_ids, skip_special_tokens=False)


def echo_logprobs(choice: ChoiceOutput, text: TokenText) -> dict[str, Any]:
    """The prompt's part of a completions logprobs list (``echo``): its first token has none
    (nothing comes before it), each later one the worker's logprob."""
    entries: list[TokenLogprobs | None] = [None, *choice.prompt_logprobs]
    entries += [None] * (len(choice.prompt_token_ids) - len(entries))
    tokens, offsets = [], []
    for token_id in choice.prompt_token_ids:
        token = text(token_id)
        tokens.append(token)
        offsets.append(choice.text_offset)
        choice.text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [finite(e.logprob) if e is not None else None for e in entries],
        "top_logprobs": [dict(_top(e, text)) if e is not None else None for e in entries],
        "text_offset": offsets,
    }


def vllm_prompt_logprobs(choice: ChoiceOutput, text: TokenText) -> list[Any]:
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first) a map from token id
    to its logprob, rank (1: the likeliest) and text: the prompt's own token and the top-n."""
    out: list[Any] = [None]
    for e in choice.prompt_logprobs:
        top = zip(e.top_token_ids, e.top_logprobs, strict=True)
        entry = {
            str(t): {"logprob": finite(lp), "rank": rank + 1, "decoded_token": text(t)}
            for rank, (t, lp) in enumerate(top)
        }
        if str(e.token_id) not in entry:
            rank = 1 + sum(lp > e.logprob for lp in e.top_logprobs)
            entry[str(e.token_id)] = {
                "logprob": finite(e.logprob),
                "rank": rank,
                "decoded_token": text(e.token_id),
            }
        out.append(entry)
    return out


def _logprobs(
    kind: Kind,
    entries: Sequence[TokenLogprobs],
    text: TokenText,
    choice: ChoiceOutput,
) -> dict[str, Any]:
    if kind is Kind.CHAT:
        return chat_logprobs(entries, text)
    return completion_logprobs(entries, text, choice)


@dataclass(frozen=True)
class Envelope:
    """What every body and chunk of one response shares."""

    kind: Kind
    id: str
    created: int
    model: str
    logprobs: bool
    return_token_ids: bool
    echo: bool = False  # completions: the prompt leads each choice's text and logprobs
    prompt_logprobs: bool = False  # vLLM's per-choice ``prompt_logprobs`` list

    def head(self, chunk: bool) -> dict[str, Any]:
        obj = self.kind.chunk_object if chunk else self.kind.object
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def response_body(
    env: Envelope, choices: Sequence[ChoiceOutput], text: TokenText, tools: ToolPlan = NO_TOOLS
) -> dict[str, Any]:
    """A whole (non-streamed) response; a chat's tool calls parsed out of its text."""
    body = env.head(chunk=False)
    out = []
    for c in choices:
        replay = ChoiceOutput(c.index, c.prompt_index, c.prompt_token_ids)
        replay.prompt_text, replay.prompt_logprobs = c.prompt_text, c.prompt_logprobs
        logprobs = None
        if env.logprobs:
            lead = echo_logprobs(replay, text) if env.echo else None
            logprobs = _logprobs(env.kind, c.logprobs, text, replay)
            if lead is not None:
                logprobs = {k: lead[k] + logprobs[k] for k in lead}
        item: dict[str, Any] = {"index": c.index}
        finish_reason = c.finish_reason
        if env.kind is Kind.CHAT:
            item["message"] = {"role": "assistant", "content": c.text}
            if tools.mode is not ToolMode.NONE:
                content, calls = tools.calls(c.text)
                item["message"]["content"] = content
                if calls:
                    item["message"]["tool_calls"] = [call.body() for call in calls]
                finish_reason = tools.finish_reason(calls, finish_reason)
        else:
            item["text"] = echo_text(c, text) + c.text if env.echo else c.text
        item["logprobs"] = logprobs
        item["finish_reason"] = finish_reason
        if env.prompt_logprobs:
            item["prompt_logprobs"] = vllm_prompt_logprobs(c, text)
        if env.return_token_ids:
            item["token_ids"] = c.token_ids
            if env.kind is Kind.COMPLETION:
                item["prompt_token_ids"] = c.prompt_token_ids
        out.append(item)
    body["choices"] = out
    if env.return_token_ids and env.kind is Kind.CHAT and choices:
        body["prompt_token_ids"] = choices[0].prompt_token_ids
    body["usage"] = total_usage(choices)
    return body


def chunk_body(
    env: Envelope,
    choice: ChoiceOutput,
    text: str,
    token_ids: Sequence[int],
    entries: Sequence[TokenLogprobs],
    token_text: TokenText,
    *,
    first: bool = False,
    finish_reason: str | None = None,
    include_usage: bool = False,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One streamed chunk of one choice. ``first``: the choice's opening chunk, which carries
    the role (chat: sent before any token, content "") and, with ``return_token_ids``, the
    prompt's ids. ``tool_calls``: a chat's calls, each whole in one delta."""
    body = env.head(chunk=True)
    item: dict[str, Any] = {"index": choice.index}
    if env.kind is Kind.CHAT:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
        if text and not first:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        item["delta"] = delta
    else:
        item["text"] = text
    item["logprobs"] = (
        _logprobs(env.kind, entries, token_text, choice) if env.logprobs and entries else None
    )
    item["finish_reason"] = finish_reason
    if env.return_token_ids:
        item["token_ids"] = list(token_ids)
        if first and env.kind is Kind.COMPLETION:
            item["prompt_token_ids"] = choice.prompt_token_ids
    body["choices"] = [item]
    if env.return_token_ids and first and env.kind is Kind.CHAT:
        body["prompt_token_ids"] = choice.prompt_token_ids
    if include_usage:
        body["usage"] = None  # as OpenAI: every chunk has the field, the last one the numbers
    return body


def prompt_chunk(
    env: Envelope, choice: ChoiceOutput, token_text: TokenText, include_usage: bool
) -> dict[str, Any]:
    """A streamed choice's chunk with its prompt, before any generated token: a completion's
    with ``echo`` (the prompt's text and logprobs) or ``prompt_logprobs``, a chat's with
    ``prompt_logprobs`` (as the whole response's choice carries them)."""
    body = env.head(chunk=True)
    item: dict[str, Any] = {"index": choice.index}
    if env.kind is Kind.CHAT:
        item["delta"] = {}
    else:
        item["text"] = echo_text(choice, token_text) if env.echo else ""
    item["logprobs"] = echo_logprobs(choice, token_text) if env.echo and env.logprobs else None
    item["finish_reason"] = None
    if env.prompt_logprobs:
        item["prompt_logprobs"] = vllm_prompt_logprobs(choice, token_text)
    body["choices"] = [item]
    if include_usage:
        body["usage"] = None
    return body


def usage_chunk(env: Envelope, choices: Sequence[ChoiceOutput]) -> dict[str, Any]:
    body = env.head(chunk=True)
    body["choices"] = []
    body["usage"] = total_usage(choices)
    return body
