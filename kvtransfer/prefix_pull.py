"""A worker's side of a peer pull (docs/kv-cache.md): before it computes a prompt, the blocks
of the prompt's cached prefix it lacks are pulled from the prefill worker the router named
(``PrefixSource``), through the same checked, leased KV transfer as prefill -> decode.

The steps, each bounded:
1. The holder must be a known prefill worker (``PeerDirectory``, ``pdserve/worker/peers.py``):
   never an address a caller names. Then the engine takes room for the blocks it lacks
   (``borrow_prefix``).
2. ``LeasePrefix`` on the holder pins what it caches of them under a lease; the handle must
   name the holder's own KV sender and the digest of exactly these tokens.
3. The receiver writes them (checksums checked); the lease is released, success or not
   (``LeaseReleaser``; expiry is the backstop), and the engine caches what landed.

A pull only saves work: any failure (the holder unknown, gone, stalled, its blocks evicted, a
digest that fails) is counted by reason and the prompt is computed here instead. What the
borrow holds is given back once the request that needed it is done (``pulled``, a context).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc

from engine.serving_engine import EngineDeadError, PeerPullUnsupported, ServingEngine
from kvtransfer import KVReceiver, KVTransferError
from kvtransfer.base import KVHandle, prompt_digest
from kvtransfer.wire import handle_from_proto
from pdserve.common import metrics
from pdserve.common.channels import ChannelPool
from pdserve.common.lease_release import LeaseReleaser
from pdserve.v1 import prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)


class PullRefused(Exception):
    """The pull cannot go on (a reason for the counter, and a message for the log)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Pulled:
    """What a pull brought: whole blocks, and the tokens they hold."""

    num_blocks: int = 0
    num_tokens: int = 0
    seconds: float = 0.0  # from the holder's lookup to the blocks cached


class PrefixPuller:
    def __init__(
        self,
        engine: ServingEngine,
        receiver: KVReceiver | None,
        kv_sender_of: Callable[[str], Awaitable[str | None]],
        channels: ChannelPool,
        releaser: LeaseReleaser,
        timeout_s: float,
    ) -> None:
        """``timeout_s`` bounds the holder's ``LeasePrefix`` answer (the receiver bounds the
        pull itself). ``receiver``: None for an engine that takes no remote KV (every pull
        then falls back, counted as ``unsupported``). ``kv_sender_of(address)``: the KV
        sender of the prefill worker at a control address, None when it is no known one
        (``PeerDirectory.kv_sender``)."""
        self.engine = engine
        self.receiver = receiver
        self.kv_sender_of = kv_sender_of
        self.channels = channels
        self.releaser = releaser
        self.timeout_s = timeout_s

    @contextlib.asynccontextmanager
    async def pulled(
        self, request_id: str, prompt: list[int], source: prefill_pb2.PrefixSource | None
    ) -> AsyncIterator[Pulled]:
        """Pulls what ``source`` offers of ``prompt``'s prefix (nothing without one), and
        holds it in the engine for the body's request; never raises for a failed pull."""
        # Its own id: a second call under the same request id must never touch this one's.
        borrow_id = f"{request_id}/prefix-{uuid.uuid4().hex[:12]}"
        try:
            got = Pulled()
            if source is not None and source.holder_address and source.num_blocks:
                got = await self._pull(request_id, borrow_id, prompt, source)
            yield got
        finally:
            # A dead engine's blocks go with it; the request's own call says it died.
            with contextlib.suppress(PeerPullUnsupported, EngineDeadError):
                await self.engine.give_back(borrow_id)

    async def _pull(
        self, request_id: str, borrow_id: str, prompt: list[int], source: prefill_pb2.PrefixSource
    ) -> Pulled:
        size = self.engine.block_size
        # A token is always left to compute (its logits give the first token).
        num_blocks = min(source.num_blocks, (len(prompt) - 1) // size)
        holder = source.holder_address
        started = time.monotonic()
        if self.receiver is None:
            return _failed(request_id, "unsupported", "this engine takes no remote KV")
        try:
            kv_sender = await self.kv_sender_of(holder)
            if kv_sender is None:
                raise PullRefused("unknown_holder", f"{holder!r} is not a known prefill worker")

            async def fill(first: int, block_ids: list[int]) -> int:
                return await self._lease_and_pull(holder, kv_sender, prompt, first, block_ids)

            written = await self.engine.borrow_prefix(borrow_id, prompt, num_blocks, fill)
        except PullRefused as exc:
            return _failed(request_id, exc.reason, str(exc))
        except KVTransferError as exc:
            return _failed(request_id, exc.code.value, str(exc))
        except grpc.aio.AioRpcError as exc:
            return _failed(request_id, "holder_" + exc.code().name.lower(), str(exc.details()))
        except (PeerPullUnsupported, ValueError) as exc:
            return _failed(request_id, "unsupported", str(exc))
        except EngineDeadError as exc:  # the request's own engine call reports it, by name
            return _failed(request_id, "engine_dead", str(exc))
        seconds = time.monotonic() - started
        if written:
            metrics.PEER_PULL_TOKENS.inc(written * size)
            metrics.PEER_PULL_S.observe(seconds)
        return Pulled(written, written * size, seconds if written else 0.0)

    async def _lease_and_pull(
        self, holder: str, kv_sender: str, prompt: list[int], first: int, block_ids: list[int]
    ) -> int:
        """The engine's ``fill``: leases blocks ``first``.. on the holder, pulls them into
        ``block_ids`` and releases the lease; returns the blocks written."""
        size = self.engine.block_size
        want = prompt[: (first + len(block_ids)) * size]
        stub = prefill_pb2_grpc.PrefillWorkerStub(self.channels.get(holder))
        request = prefill_pb2.LeasePrefixRequest(prompt_token_ids=want, first_block=first)
        reply = await stub.LeasePrefix(request, timeout=self.timeout_s)
        if not reply.HasField("lease"):
            raise PullRefused("not_cached", f"{holder} no longer caches block {first}")
        lease = reply.lease
        try:
            handle = handle_from_proto(lease)
            n = handle.num_blocks
            _check(handle, kv_sender, prompt[: (first + n) * size], 1 <= n <= len(block_ids))
            assert self.receiver is not None  # checked before the borrow
            pull = asyncio.ensure_future(self.receiver.pull(handle, block_ids[:n]))
            try:
                stats = await asyncio.shield(pull)
            except asyncio.CancelledError:
                pull.cancel()  # it stops writing before the engine gives the blocks back,
                while not pull.done():  # however often this caller is cancelled meanwhile
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.wait([pull])
                raise
        finally:  # success or not, and whatever the handle held (expiry is the backstop)
            self.releaser.release_later(holder, lease.request_id, lease.lease_token)
        metrics.TRANSFER_BYTES.labels("peer_received").inc(stats.num_bytes)
        return n


def _check(handle: KVHandle, kv_sender: str, tokens: list[int], count_ok: bool) -> None:
    if handle.address != kv_sender:
        raise PullRefused("wrong_sender", f"handle.address {handle.address!r} is not the holder's")
    if not count_ok:
        raise PullRefused("bad_handle", f"handle.num_blocks {handle.num_blocks} out of range")
    if handle.prompt_digest != prompt_digest(tokens):
        raise PullRefused("digest_mismatch", "handle.prompt_digest does not match the prefix")


def _failed(request_id: str, reason: str, message: str) -> Pulled:
    metrics.PEER_PULL_FAILURES.labels(reason).inc()
    logger.warning(
        "request_id=%s peer pull failed (%s): %s; computing", request_id, reason, message
    )
    return Pulled()
