"""One request's updates on their way from an engine's loop to the request's stream, for every
engine behind the serving contract.

Output is bounded per request: once ``max_buffered_tokens`` wait here, the engine pauses the
request (``paused``: it holds no seat, nothing of it is scheduled), and resumes it when its
reader has taken half of them (``wants_resume``). With ``heartbeat_s``, a reader waiting that
long gets an empty update, so that it can tell a quiet request (queued for a seat, a long
chunked prefill) from a stalled process.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from engine.outputs import RequestUpdate


@dataclass(eq=False)
class UpdateQueue:
    """Written by the engine's loop (``put``, ``fail``), read by the request's stream (``take``),
    both on the event loop."""

    items: asyncio.Queue[RequestUpdate | BaseException] = field(default_factory=asyncio.Queue)
    num_buffered_tokens: int = 0  # in the queue, not yet taken
    paused: bool = False  # the engine paused the request for its reader

    def put(self, update: RequestUpdate) -> None:
        self.items.put_nowait(update)
        self.num_buffered_tokens += len(update.new_token_ids)

    def fail(self, error: BaseException) -> None:
        """The reader's next ``take`` raises ``error``."""
        self.items.put_nowait(error)

    def full(self, max_buffered_tokens: int) -> bool:
        return self.num_buffered_tokens >= max_buffered_tokens

    def wants_resume(self, max_buffered_tokens: int) -> bool:
        return self.paused and self.num_buffered_tokens <= max_buffered_tokens // 2

    async def take(self, request_id: str, heartbeat_s: float | None) -> RequestUpdate:
        try:
            async with asyncio.timeout(heartbeat_s):
                item = await self.items.get()
        except TimeoutError:  # nothing new: an empty update tells the reader we are alive
            return RequestUpdate(request_id, [], "", [], None)
        if isinstance(item, BaseException):
            raise item
        self.num_buffered_tokens -= len(item.new_token_ids)
        return item
