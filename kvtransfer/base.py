"""The KV transfer contract: a sender on each prefill worker, a receiver on each decode worker.

Block ownership across the two workers (who frees what, and when). This is the one statement of
the rule; the engine hooks, the lease manager, the release client and the services link here.
- Prefill side. The engine pins a request's blocks after its first token; the prefill service's
  ``LeaseManager`` leases them (``BlockLeases``) and is the only one that frees them (engine
  ``free_pinned``), exactly once: when the lease ends (RPC ``Release``), when it expires, or
  when the worker stops. The sender only *reads* them, between ``checkout`` and ``checkin``;
  while checked out, neither an end nor expiry frees them (the free is deferred to the
  checkin). The sender never frees a block.
- Until a decode worker admits the request (its first stream message), the router owns ending
  the lease; from then on the decode worker does. Both end it with ``Release`` through the one
  client, ``pdserve.common.lease_release``; a lost ``Release`` leaves it to expiry.
- Decode side. The decode service allocates the destination blocks *before* calling ``pull`` and
  owns them throughout. ``pull`` only writes them. When ``pull`` returns or raises (including on
  cancellation), it has stopped writing: the caller may free or reuse the blocks at once.
- After a pull, success or failure, the decode service ends the prefill lease (the "confirm").
  If it never does, the lease expires and the prefill side frees the blocks.
- Peer pull (docs/kv-cache.md): the same rule with the roles of a cached prefix. The holder
  (a prefill worker) pins its cached blocks under a lease of its own making (``LeasePrefix``;
  engine ``lend_prefix``), freed as any lease is. The puller (``PrefixPuller``) allocates the
  destination blocks before ``pull`` (engine ``borrow_prefix``), owns them throughout, ends
  the lease after the pull, success or not, and gives the blocks back (``give_back``) once the
  request that needed them is done.

Errors are ``KVTransferError`` with a ``TransferErrorCode``; services map codes to gRPC statuses.
Nothing is pickled: the wire carries raw tensor bytes described by a ``KVCacheLayout``.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import secrets
import struct
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.kv_layout import KVCacheLayout
from pdserve.common import tracing
from pdserve.common.tracing import TraceContext

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from opentelemetry.context import Context

    from engine.kv_pages import KVPages


class TransferErrorCode(enum.Enum):
    NOT_FOUND = "not_found"  # the sender holds no lease for the request (expired or ended)
    LAYOUT_MISMATCH = "layout_mismatch"  # sender and receiver caches are not interchangeable
    CORRUPTED = "corrupted"  # checksum, offset or size check failed
    UNAVAILABLE = "unavailable"  # the sender cannot be reached or the stream broke


class KVTransferError(Exception):
    def __init__(self, code: TransferErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class KVHandle:
    """Everything a receiver needs to pull one request's blocks; travels prefill -> router ->
    decode inside ``PrefillResponse``/``DecodeRequest``."""

    backend: str
    address: str  # backend-specific endpoint of the sender
    request_id: str
    num_blocks: int
    layout: KVCacheLayout
    lease_s: float
    # Proof of the lease: pulls, Release and RenewLease must present it.
    lease_token: str = ""
    # prompt_digest() of the token ids whose KV the blocks hold.
    prompt_digest: bytes = b""


def new_lease_token() -> str:
    """Unguessable: 128 random bits."""
    return secrets.token_hex(16)


def prompt_digest(token_ids: list[int]) -> bytes:
    """BLAKE2b-128 of token ids (little-endian uint32): which prompt a handle's KV is of."""
    payload = struct.pack(f"<{len(token_ids)}I", *token_ids)
    return hashlib.blake2b(payload, digest_size=16, person=b"pdserve-prompt").digest()


def same_token(a: str, b: str) -> bool:
    """Constant-time comparison of lease tokens."""
    return hmac.compare_digest(a.encode(), b.encode())


@dataclass(frozen=True)
class TransferStats:
    num_bytes: int
    duration_s: float


class BlockLeases(ABC):
    """Prefill-side view of leased requests; implemented by the prefill service."""

    @abstractmethod
    async def checkout(self, request_id: str, lease_token: str) -> list[int]:
        """The leased request's block ids. They stay allocated until ``checkin``.
        Raises ``KeyError`` when the request holds no lease, or ``lease_token`` is not its
        token (the two look alike to the caller: a token must not be probed). A coroutine: a
        tensor-parallel rank's sender asks the lease table in its worker's process
        (``vllm_engine/rank_runtime.py``)."""

    @abstractmethod
    async def checkin(self, request_id: str) -> None:
        """Ends one checkout; frees the blocks if the lease ended or expired meanwhile."""


@dataclass(frozen=True)
class BlockRead:
    """One read of a leased request's blocks by a sender (``KVSender.begin_read``)."""

    request_id: str
    block_ids: list[int]
    parent: Context | None  # the puller's span: this read is traced under it
    start_s: float  # perf_counter at checkout


class KVSender(ABC):
    """Prefill side: serves pulls of leased blocks from ``cache``. Created and started by the
    prefill service; ``address`` goes into every ``KVHandle`` it issues. A pull reads the
    blocks between ``begin_read`` and ``end_read`` (they wrap the leases' checkout/checkin)."""

    backend: str

    def __init__(self, cache: KVPages, leases: BlockLeases) -> None:
        self.cache = cache
        self.leases = leases

    @property
    def layout(self) -> KVCacheLayout:
        """What its handles name: the pages' layout (a tensor-parallel engine's rank 0's)."""
        return self.cache.layout

    async def begin_read(
        self, request_id: str, lease_token: str, trace: TraceContext = ()
    ) -> BlockRead:
        """``BlockLeases.checkout`` (raises its ``KeyError``), and the start of this sender's
        span of the read (``prefill_worker.kv_send``, until its ``end_read``) under ``trace``:
        the receiver's pull span, sent along with the pull (``KVReceiver.pull``). Every read
        begun is ended exactly once, with what this returned."""
        parent = tracing.worker_context(trace)  # first: nothing can fail once checked out
        block_ids = await self.leases.checkout(request_id, lease_token)
        return BlockRead(request_id, block_ids, parent, time.perf_counter())

    async def end_read(self, read: BlockRead) -> None:
        """``BlockLeases.checkin``, and the end of the read's span (when traced). A failure
        to record the span costs the read nothing."""
        try:
            if read.parent is not None:
                attributes: dict[str, int | str] = {
                    "pdserve.kv_blocks": len(read.block_ids),
                    "pdserve.kv_backend": self.backend,
                }
                end_s = time.perf_counter()
                tracing.record(
                    "prefill_worker.kv_send", read.parent, read.start_s, end_s, attributes
                )
        except Exception:
            logger.exception("request_id=%s: the KV send span was not recorded", read.request_id)
        finally:
            await self.leases.checkin(read.request_id)

    @property
    @abstractmethod
    def address(self) -> str: ...

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def stop(self) -> None: ...

    def lease_ended(self, request_id: str) -> None:
        """Called by the prefill service once the request's lease is over (ended, expired
        or aborted) and its blocks are freed. Backends that staged a copy of the blocks (the
        Ray object store) drop it here; the others hold nothing."""
        return None

    def handle(
        self,
        request_id: str,
        num_blocks: int,
        lease_s: float,
        lease_token: str,
        digest: bytes,
    ) -> KVHandle:
        return KVHandle(
            self.backend,
            self.address,
            request_id,
            num_blocks,
            self.layout,
            lease_s,
            lease_token,
            digest,
        )


class KVReceiver(ABC):
    """Decode side: writes a remote request's blocks into ``cache``. One per decode worker."""

    backend: str

    def __init__(self, cache: KVPages) -> None:
        self.cache = cache

    @property
    def layout(self) -> KVCacheLayout:
        """What a handle's layout must equal (``check_handle``)."""
        return self.cache.layout

    @abstractmethod
    async def pull(
        self, handle: KVHandle, block_ids: list[int], trace: TraceContext = ()
    ) -> TransferStats:
        """Fills ``block_ids`` (allocated by the caller, ``len == handle.num_blocks``) with the
        handle's blocks, in order. Raises ``KVTransferError``; see the module docstring for the
        guarantee on return. ``trace``: the caller's span of the pull (``tracing.metadata``),
        carried to the sender's ``begin_read`` so that its span joins the request's trace."""

    async def close(self) -> None:
        """Releases connections."""
        return None

    async def retain_peers(self, kv_addresses: set[str]) -> None:
        """Called by the decode service whenever its set of prefill peers changes (their KV
        senders' addresses): drop what is kept for any other sender (connections, NIXL remote
        agents, handshake locks), so departed peers do not accumulate. A pull in flight keeps
        what it uses until it ends."""
        return None

    def layout_refusal(self, layout: KVCacheLayout) -> str | None:
        """Why a handle of ``layout`` cannot be pulled here (None: it can): a layout equal to
        this receiver's. A receiver that maps tensor-parallel shards says more
        (``kvtransfer/shard_receiver.py``)."""
        return self.layout.mismatch(layout)

    def check_handle(self, handle: KVHandle, block_ids: list[int]) -> None:
        mismatch = self.layout_refusal(handle.layout)
        if mismatch is not None:
            raise KVTransferError(TransferErrorCode.LAYOUT_MISMATCH, mismatch)
        if handle.backend != self.backend:
            raise KVTransferError(
                TransferErrorCode.UNAVAILABLE,
                f"handle backend {handle.backend!r} != receiver backend {self.backend!r}",
            )
        if len(block_ids) != handle.num_blocks:
            raise ValueError(f"{len(block_ids)} destination blocks for {handle.num_blocks}")
