"""Running blocking work in a thread from asyncio without losing track of it on cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def finish_in_thread(fn: Callable[..., T], *args: object) -> T:
    """``asyncio.to_thread`` that, if cancelled, waits for the thread to finish before
    re-raising. A cancelled ``to_thread`` returns at once while the thread keeps running; callers
    that free or reuse what the thread touches (KV blocks, engine state) must not do that."""
    future = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait([future])
        raise
