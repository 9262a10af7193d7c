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

from router.request import Request
from router.request_core import RequestCore
from router.result import Result

_QUEUED_PER_CHOICE = 4


@dataclass(frozen=True)
class Choice:
    index: int
    request: Request  # read (``RequestCore.read``): its prompt as ids, its own seed


async def merged(
    core: RequestCore, choices: list[Choice]
) -> AsyncGenerator[tuple[int, Result], None]:
    """(choice index, result) until every choice sent its final. Raises the first
    choice's error (``WorkerError``), after cancelling the others."""
    if len(choices) == 1:  # the common case: no task, no queue
        only = choices[0]
        stream = core.responses(only.request)
        async with contextlib.aclosing(stream):
            async for result in stream:
                yield only.index, result
        return
    Item = tuple[int, Result | BaseException | None]
    queue: asyncio.Queue[Item] = asyncio.Queue(_QUEUED_PER_CHOICE * len(choices))

    async def run(choice: Choice) -> None:
        stream = core.responses(choice.request)
        try:
            async with contextlib.aclosing(stream):
                async for result in stream:
                    await queue.put((choice.index, result))
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
