"""What each choice repeats of its prompt: ``echo`` (completions: the prompt's text and, with
logprobs, its tokens' logprobs) and vLLM's ``prompt_logprobs`` (either endpoint).

A prompt's logprobs are computed once, by its first choice (``prepare.prepare`` asks only
that one: a request that wants them takes no prefix-cache hit, so asking every choice cost
``n`` full prefills); every other choice of the prompt carries a copy. A whole response copies
them at the end (``share_prompt_logprobs``); a stream opens each choice with its prompt
(``PromptLeads``), holding a choice's responses until its prompt's logprobs are here. Such a
piece is built and encoded off the event loop when the prompt is long (``prompt_event``): an
8k-token prompt's with 20 top logprobs is megabytes of JSON.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence

from engine.sequence import TokenLogprobs
from router.openai.responses import ChoiceOutput, Envelope, Kind, TokenText, prompt_chunk
from router.openai.sse import event
from router.result import Chunk, Result

# A prompt longer than this is built and encoded in a thread.
_IN_THREAD_PROMPT_TOKENS = 256


def share_prompt_logprobs(outputs: Sequence[ChoiceOutput]) -> None:
    """Every choice of a prompt gets the logprobs its first choice computed."""
    computed: dict[int, list[TokenLogprobs]] = {}
    for c in outputs:
        computed.setdefault(c.prompt_index, c.prompt_logprobs)
    for c in outputs:
        if not c.prompt_logprobs:
            c.prompt_logprobs = computed[c.prompt_index]


def response_weight(env: Envelope, c: ChoiceOutput) -> int:
    """Roughly how many tokens' worth of JSON a choice makes (what decides whether its whole
    response is encoded in a thread)."""
    weight = len(c.token_ids) + 20 * (len(c.logprobs) + len(c.prompt_logprobs))
    return weight + (len(c.prompt_token_ids) if env.echo else 0)


class PromptLeads:
    """Opens each streamed choice with its prompt, once its prompt's first choice brought the
    logprobs (in its first chunk): the responses of the prompt's other choices wait until
    then, in order."""

    def __init__(self, env: Envelope, outputs: Sequence[ChoiceOutput]) -> None:
        self.wanted = (env.kind is Kind.COMPLETION and env.echo) or env.prompt_logprobs
        self._outputs = outputs
        self._first: dict[int, int] = {}  # prompt index -> the choice that computes its logprobs
        for c in outputs:
            self._first.setdefault(c.prompt_index, c.index)
        self._known: set[int] = set()  # prompts whose logprobs are here
        self._held: dict[int, list[tuple[int, Result]]] = {}
        self._opened: set[int] = set()

    async def ready(
        self, stream: AsyncGenerator[tuple[int, Result], None]
    ) -> AsyncGenerator[tuple[int, Result], None]:
        """``stream``'s responses, each once its choice's prompt logprobs are known."""
        async for index, result in stream:
            if not self.wanted:
                yield index, result
                continue
            p = self._outputs[index].prompt_index
            if p in self._known:
                yield index, result
            elif index != self._first[p]:
                self._held.setdefault(p, []).append((index, result))
            else:
                computed = list(result.prompt_logprobs) if isinstance(result, Chunk) else []
                for c in self._outputs:
                    if c.prompt_index == p:
                        c.prompt_logprobs = computed
                self._known.add(p)
                yield index, result
                for held in self._held.pop(p, []):
                    yield held

    def opens(self, index: int) -> bool:
        """Whether choice ``index``'s prompt comes now (once, before its first response)."""
        if not self.wanted or index in self._opened:
            return False
        self._opened.add(index)
        return True


async def prompt_event(env: Envelope, c: ChoiceOutput, text: TokenText, usage: bool) -> bytes:
    """A streamed choice's opening event with its prompt; a long one built off the loop."""

    def build() -> bytes:
        return event(prompt_chunk(env, c, text, usage))

    if len(c.prompt_token_ids) <= _IN_THREAD_PROMPT_TOKENS:
        return build()
    return await asyncio.to_thread(build)
