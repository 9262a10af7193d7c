"""The HTTP client leaving: ``disconnected`` returns once it has gone, ``until`` runs work that
is cancelled if it goes first (``ClientGone``). The request's body must have been read already:
what ``receive`` gives after it is the connection's end."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.types import Receive

T = TypeVar("T")


async def disconnected(receive: Receive) -> None:
    """Returns once the client has gone (the request body must have been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    """The client disconnected before its response began."""


async def until(receive: Receive, work: Awaitable[T]) -> T:
    """``work``, cancelled if the client disconnects first (``ClientGone``; ``receive``: the
    request's, its body already read). Cancelling the caller cancels both."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected(receive))
    try:
        await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        for t in (task, watch):
            t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
        raise
    if task.done():
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone()
