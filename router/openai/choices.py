"""The choices of one OpenAI request (``n`` per prompt, several prompts) run as independent
requests on the workers, their responses merged into one stream in arrival order.

Each choice is its own request through ``RequestCore.responses`` (counted in flight,
migrated on worker failures). A bounded queue carries their messages, so a slow client slows
the choices down instead of buffering their output here. When the merged stream is closed
(done, failed, or the client went away) every choice still running is cancelled, which frees
what it holds on the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from engine.sampling_params import SamplingParams
from pdserve.v1 import router_pb2
from router.request_core import RequestCore

_QUEUED_PER_CHOICE = 4


@dataclass(frozen=True)
class Choice:
    index: int
    prompt_index: int
    prompt_token_ids: list[int]
    params: SamplingParams


async def merged(
    core: RequestCore, client_id: str, caller: str, choices: list[Choice], start_s: float
) -> AsyncGenerator[tuple[int, router_pb2.GenerateResponse], None]:
    """(choice index, response) until every choice sent its final. Raises the first
    choice's error (``WorkerError``), after cancelling the others. ``caller``:
    ``RequestCore.caller``'s."""
    if len(choices) == 1:  # the common case: no task, no queue
        only = choices[0]
        stream = core.responses(client_id, caller, only.prompt_token_ids, only.params, start_s)
        async with contextlib.aclosing(stream):
            async for response in stream:
                yield only.index, response
        return
    Item = tuple[int, router_pb2.GenerateResponse | BaseException | None]
    queue: asyncio.Queue[Item] = asyncio.Queue(_QUEUED_PER_CHOICE * len(choices))

    async def run(choice: Choice) -> None:
        stream = core.responses(
            f"{client_id}-{choice.index}", caller, choice.prompt_token_ids, choice.params, start_s
        )
        try:
            async with contextlib.aclosing(stream):
                async for response in stream:
                    await queue.put((choice.index, response))
        except Exception as exc:
            await queue.put((choice.index, exc))
            return
        await queue.put((choice.index, None))

    tasks = [asyncio.create_task(run(c), name=f"choice-{c.index}") for c in choices]
    try:
        finished = 0
        while finished < len(tasks):
            index, item = await queue.get()
            if item is None:
                finished += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
