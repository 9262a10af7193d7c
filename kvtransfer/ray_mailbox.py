"""The rendezvous of the Ray backend: a small async actor per KV sender.

A Ray object can only reach another process through Ray (an ``ObjectRef`` smuggled through our
gRPC wire would need out-of-band pickling, and Ray would then never free it). A sender may be a
plain process, not an actor, so it cannot be called; instead it long-polls its mailbox for pull
requests and answers each layer range with the ``ObjectRef`` of the blocks it put; the mailbox
streams the answers to the receiver. It only relays references (bytes stay in the object store)
and fate-shares with the sender that created it.

Who holds which reference: the sender keeps its ``ObjectRef`` until the request's lease ends;
the mailbox drops its copy as soon as it has answered; the receiver drops its copy once the
blocks are in its cache. Ray frees the object when the last of them is gone.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import ray

from engine.kv_layout import KVCacheLayout
from kvtransfer.base import TransferErrorCode
from pdserve.common.tracing import TraceContext


@dataclass(frozen=True)
class LayerRange:
    """Layers ``[first, first + count)``: one object of a pull. The sender stages range k+1
    while the receiver writes range k."""

    first: int
    count: int


@dataclass(frozen=True)
class PullTicket:
    ticket: int  # unique per pull: the same request may be pulled twice at once
    request_id: str
    ranges: tuple[LayerRange, ...]  # answered in this order, one reply each
    lease_token: str = ""  # from the handle: the sender checks it
    trace: TraceContext = ()  # the receiver's pull span


@dataclass(frozen=True)
class ExportReply:
    """A sender's answer to one ask: an error, or one object with the range's layers of the
    request's blocks, and how to check it."""

    error: TransferErrorCode | None = None
    message: str = ""
    layout: KVCacheLayout | None = None
    num_blocks: int = 0
    # One xxh3-64 digest per layer of the payload ``[layers.count, 2 * num_blocks * slab]``.
    layer_digests: tuple[int, ...] = ()
    # The payload, wrapped in a list so that Ray passes the reference, not the bytes.
    refs: list[Any] = field(default_factory=list)


class KVMailbox:
    """Receivers call ``request`` (a streaming generator: one reply per layer range, in
    order); the sender calls ``next_tickets`` and ``answer`` (once per range)."""

    def __init__(self) -> None:
        self._tickets: asyncio.Queue[PullTicket] = asyncio.Queue()
        self._replies: dict[int, asyncio.Queue[ExportReply]] = {}
        self._ids = itertools.count()

    async def request(
        self,
        request_id: str,
        ranges: tuple[LayerRange, ...],
        lease_token: str = "",
        trace: TraceContext = (),
    ) -> AsyncIterator[ExportReply]:
        ticket = PullTicket(next(self._ids), request_id, ranges, lease_token, trace)
        replies: asyncio.Queue[ExportReply] = asyncio.Queue()
        self._replies[ticket.ticket] = replies
        self._tickets.put_nowait(ticket)
        try:
            for _ in ranges:
                reply = await replies.get()
                yield reply
                if reply.error is not None:
                    return
        finally:
            self._replies.pop(ticket.ticket, None)  # a cancelled pull drops later replies

    async def next_tickets(self) -> list[PullTicket]:
        tickets = [await self._tickets.get()]
        while not self._tickets.empty():
            tickets.append(self._tickets.get_nowait())
        return tickets

    async def answer(self, ticket: int, reply: ExportReply) -> None:
        replies = self._replies.get(ticket)
        if replies is not None:
            replies.put_nowait(reply)


def spawn_mailbox(name: str, namespace: str) -> Any:
    """A mailbox on this process's node; it dies with the process that spawned it."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(KVMailbox).options(
        name=name,
        namespace=namespace,
        num_cpus=0,
        max_concurrency=10_000,  # one pending coroutine per in-flight pull
        scheduling_strategy=here,
    )
    return actor.remote()
