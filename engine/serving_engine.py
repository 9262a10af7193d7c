"""The one contract between the worker services and an engine.

``prefill_service``, ``decode_service`` and ``pdserve.worker`` (and the cluster ``Membership``)
call an engine only through ``ServingEngine``. Two engines implement it: the native one
(``native_engine.async_engine.AsyncEngine``, the exact reference and the CPU default) and vLLM
(``vllm_engine.engine.VllmEngine``). Every method is called on the worker's event loop; none
blocks it.

Block ownership across two workers (who frees which block, and when) is the contract in
``kvtransfer/base.py``; the hooks here are its engine side:
- Prefill side: ``generate(..., prefill_only=True)`` ends with an update whose ``prefilled`` is
  set: the first token is sampled and the request's blocks are *pinned* (no step reads or writes
  them, nothing evicts them). ``export_prefilled`` names them; ``kv_pages`` reads them;
  ``free_pinned`` frees them, exactly once (the prefill service's ``LeaseManager`` is its only
  caller).
- Decode side: ``admit_prefilled`` allocates blocks for a request prefilled elsewhere and hands
  them to the caller's ``fill`` (the KV pull, which writes them through ``kv_pages``); once
  ``fill`` returns, the request joins the batch and ``stream_prefilled`` yields its updates. If
  ``fill`` raises (or the caller is cancelled), the engine frees the blocks before
  ``admit_prefilled`` raises: the caller frees nothing.
- ``abort`` stops a request wherever it is and frees what it holds.
- Peer pull (docs/kv-cache.md): a holder's ``lend_prefix`` pins cached prefix blocks under
  a lease id as a pinned request's (``free_pinned`` frees them); a puller's ``borrow_prefix``
  writes the blocks it lacks into its prefix cache through ``fill``, and ``give_back`` drops
  what the borrow holds. An engine that cannot raises ``PeerPullUnsupported``.

A request's own failure is never the engine's: a stream whose request its parameters end
mid-way (no token left to sample, its grammar failed: ``engine/request_error.py``) raises
``RequestError`` (a ``ValueError``: INVALID_ARGUMENT, not migrated), and every other request
goes on. ``EngineDeadError`` means the engine itself failed (a step raised anything else, or
its loop ended): every stream sees it, and the worker restarts.
"""

from __future__ import annotations

import asyncio
import enum
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from engine.block_hash import BlockHash
from engine.config import DEFAULT_MAX_BUFFERED_TOKENS, EngineConfig
from engine.kv_events import CacheTier, KVEvents
from engine.kv_layout import KVCacheLayout
from engine.kv_pages import KVPages
from engine.outputs import EngineStats, PrefilledRequest, RequestUpdate
from engine.request_error import RequestError
from engine.sampling_params import SamplingParams
from engine.spilled_block import SpillSink
from engine.step_progress import StepProgress

T = TypeVar("T")


class PeerPullUnsupported(ValueError):
    """This engine cannot lend or borrow cached prefix blocks (its KV layout or its cache
    does not allow it): the caller computes the prompt instead."""

    @classmethod
    def of(cls, engine: object) -> PeerPullUnsupported:
        name = type(engine).__name__
        return cls(f"peer pull of cached prefix blocks is not supported by {name}")


class FaultEvidence(enum.Enum):
    """What a dead engine can say of one request, its last words: whether the request was in
    the step that failed. The worker passes it on (``pdserve/common/engine_fault.py``), so the
    router tells the request that crashed a worker from one that was only there
    (``router/failures.py``)."""

    UNKNOWN = "unknown"  # the engine cannot say (it failed outside a step): a silent loss
    ALONE = "alone"  # the failed step held this request only: it is the cause
    IN_STEP = "in-step"  # in the failed step, with others
    BYSTANDER = "bystander"  # not in it (waiting, paused, pinned, or came after): innocent


class EngineDeadError(RuntimeError):
    """A step raised: the engine state can no longer be trusted; the worker must restart.
    ``evidence``: what the engine says of the request this stream served."""

    def __init__(self, message: str, evidence: FaultEvidence = FaultEvidence.UNKNOWN) -> None:
        super().__init__(message)
        self.evidence = evidence

    @classmethod
    def of_step(
        cls, error: BaseException, request_id: str, stepping: frozenset[str] | None
    ) -> EngineDeadError:
        """``request_id``'s view of an engine whose step failed with ``error`` while it
        stepped ``stepping`` (None: it cannot say)."""
        if stepping is None:
            evidence = FaultEvidence.UNKNOWN
        elif request_id not in stepping:
            evidence = FaultEvidence.BYSTANDER
        else:
            evidence = FaultEvidence.ALONE if len(stepping) == 1 else FaultEvidence.IN_STEP
        return cls(f"engine step failed: {error!r}", evidence)


class NoRoomError(RuntimeError):
    """``admit_prefilled``: the cache has no room for the request now (RESOURCE_EXHAUSTED: the
    router tries another worker or waits). The message names what was needed and what is free."""

    @classmethod
    def of(cls, num_free: int, num_blocks: int, needed: int) -> NoRoomError:
        return cls(
            f"this worker has {num_free} free KV blocks of {num_blocks}; prompt_token_ids "
            f"needs {needed}"
        )


@dataclass(frozen=True)
class EngineHooks:
    """What a worker service asks of the engine it is given."""

    on_stats: Callable[[EngineStats], None] | None = None  # after every step and call
    on_dead: Callable[[BaseException], None] | None = None  # once, when a step fails
    # Output tokens one request may have waiting for its reader before it is paused.
    max_buffered_tokens: int = DEFAULT_MAX_BUFFERED_TOKENS
    # A request that produced nothing for this long yields an empty update (None: never).
    heartbeat_s: float | None = None


class ServingEngine(ABC):
    """An engine as a worker service drives it. Built and started by the component builder
    (``app.components``), closed by the service."""

    # Refreshed after every step and call (never waits behind a step): what stats RPCs,
    # heartbeats and metrics read.
    stats: EngineStats
    # Set by a worker that publishes to a prefix index: then ``take_kv_events`` returns events.
    collect_kv_events: bool
    # Written by the engine's loop only: whether its steps complete (``engine/step_progress.py``).
    progress: StepProgress

    # ---- what the model and cache are (fixed once started) ---------------------------------
    @property
    @abstractmethod
    def kv_layout(self) -> KVCacheLayout:
        """What a peer must share to exchange blocks; names the engine (``page_layout``)."""

    @property
    @abstractmethod
    def kv_pages(self) -> KVPages | None:
        """The cache as the KV transfer backends read and write it (pinned or reserved blocks
        only, from their own threads: no step touches those). None when this engine cannot
        exchange KV at all (it serves colocated requests only)."""

    @property
    @abstractmethod
    def fingerprint(self) -> str:
        """Names the KV contents a block holds; seeds every block hash (``engine.block_hash``)."""

    @property
    @abstractmethod
    def block_size(self) -> int: ...

    @property
    @abstractmethod
    def num_blocks(self) -> int: ...

    @property
    @abstractmethod
    def max_model_len(self) -> int: ...

    @abstractmethod
    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` tokens occupies."""

    @property
    @abstractmethod
    def num_buffered_tokens(self) -> int:
        """Output tokens produced but not yet taken by their consumers, over all requests."""

    # ---- lifecycle --------------------------------------------------------------------------
    @abstractmethod
    def start(self) -> None:
        """Starts stepping (on the running event loop). Called once, before any request."""

    @abstractmethod
    async def close(self) -> None:
        """Stops stepping; requests still streaming see ``EngineDeadError`` or are cancelled."""

    # ---- requests ---------------------------------------------------------------------------
    @abstractmethod
    def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        prefill_only: bool = False,
        num_generated_tokens: int = 0,
    ) -> AsyncGenerator[RequestUpdate, None]:
        """Admits a request and yields its updates until it finishes (or, ``prefill_only``, is
        prefilled: the caller then owns one ``free_pinned``). ``num_generated_tokens``: the last
        that many of ``prompt_ids`` are earlier output of this request (a migration): they count
        toward ``max_tokens``, stop strings and the seeded sampler's output index. Leaving the
        generator early (cancellation, ``aclose``) aborts the request. Raises ``ValueError`` for
        a request this engine cannot take (names the field), ``RequestError`` when the
        request's own parameters end it mid-way, and ``EngineDeadError``."""

    @abstractmethod
    def export_prefilled(self, request_id: str) -> PrefilledRequest:
        """A pinned request as a decode engine resumes it: its first token (and logprobs), the
        pinned block ids (in order) and every token whose KV they hold. ``KeyError`` when it is
        not pinned."""

    @abstractmethod
    async def free_pinned(self, request_id: str) -> None:
        """Frees a pinned request's blocks (``KeyError`` on a second free). Not cancellable
        half-way: a cancelled caller does not leave the blocks pinned."""

    @abstractmethod
    async def admit_prefilled(
        self, request: PrefilledRequest, fill: Callable[[list[int]], Awaitable[T]]
    ) -> T:
        """Allocates blocks for ``request``'s prompt KV (``blocks_for(len(prompt_token_ids))``
        of them), awaits ``fill(block_ids)`` and returns what it returned; the request then
        waits in the engine for a seat. Raises ``NoRoomError`` before calling ``fill`` when the
        cache has no room, ``ValueError`` for a request this engine cannot take. If ``fill``
        raises or this is cancelled, the blocks are freed (or will be, once nothing can write
        them) and the request is gone before this raises."""

    @abstractmethod
    def stream_prefilled(self, request: PrefilledRequest) -> AsyncGenerator[RequestUpdate, None]:
        """The updates of a request ``admit_prefilled`` admitted, its first token
        (``request.first_token_id``) first. Leaving early aborts the request. Raises as
        ``generate`` does."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stops a request wherever it is and frees its blocks; a no-op when it is gone."""

    # ---- peer pull: cached prefix blocks between workers (docs/kv-cache.md) ---------------
    async def lend_prefix(
        self, lease_id: str, token_ids: list[int], first_block: int, num_blocks: int
    ) -> list[int]:
        """Pins this engine's cached blocks ``[first_block, n)`` of the prefix ``token_ids``
        starts with (``n``: the run cached from block 0, at most ``num_blocks``) under
        ``lease_id``, as a pinned request's: ``kv_pages`` reads them, ``free_pinned(lease_id)``
        frees them, exactly once. Returns them in order (none: nothing is pinned). Raises
        ``ValueError`` for a lease id in use or token ids it cannot take."""
        raise PeerPullUnsupported.of(self)

    async def borrow_prefix(
        self,
        borrow_id: str,
        token_ids: list[int],
        num_blocks: int,
        fill: Callable[[int, list[int]], Awaitable[int]],
    ) -> int:
        """Brings the first ``num_blocks`` blocks of ``token_ids`` into this engine's prefix
        cache: those from the first it lacks, ``first``, get blocks, which ``fill(first,
        block_ids)`` writes through ``kv_pages``, returning how many it wrote (from the first
        of ``block_ids``); those are then cached. Returns that count (0 too when all were
        cached here, or the cache has no room). Every block the borrow
        holds (its cached run, the written ones) stays referenced until ``give_back``, which
        the caller owes once the request that needs them is admitted, also when this raises
        (``fill`` raised: nothing is published)."""
        raise PeerPullUnsupported.of(self)

    async def give_back(self, borrow_id: str) -> None:
        """Drops what ``borrow_id`` holds (a no-op when it holds nothing). Not cancellable
        half-way."""
        raise PeerPullUnsupported.of(self)

    def spill_evicted(self, sink: SpillSink) -> bool:
        """Called once by the worker service, before any request: from then on the engine
        hands ``sink`` (from any of its threads) the blocks its last cache tier gives up, with
        their bytes, instead of only dropping them (a KV store takes them: docs/kv-cache.md).
        False: it has no tier that spills; ``sink`` is never called."""
        return False

    # ---- the prefix index's view ------------------------------------------------------------
    @abstractmethod
    def take_kv_events(self) -> list[KVEvents]:
        """Block hashes (``engine.block_hash``, this engine's ``fingerprint``) that entered
        and left the cache since the last take, oldest first."""

    @abstractmethod
    async def snapshot_cached_hashes(self) -> dict[CacheTier, list[BlockHash]]:
        """Every cached block hash per tier, with the pending events dropped in the same
        breath (the snapshot contains them)."""


# Loads the model (off the event loop) and returns the engine, not yet started: what the
# component builder gives a worker service (``app.components``).
EngineBuilder = Callable[[EngineConfig, EngineHooks], Awaitable[ServingEngine]]


def raise_on_error(update: RequestUpdate) -> RequestUpdate:
    """``update``, unless it ends its request with the request's own error: then the stream
    raises that (``RequestError``). Every engine's stream passes its updates through this."""
    if update.error is not None:
        raise RequestError(update.error)
    return update


async def run_until_dead(
    iterate: Callable[[], Awaitable[None]], die: Callable[[BaseException], None]
) -> None:
    """An engine's loop: ``iterate`` for ever, until anything but a cancellation escapes it (a
    step that raised, a delivery that failed; a Rust panic from pyo3, which is no
    ``Exception``, too): then ``die`` is told, once, and the loop ends. Every engine's loop is
    this, so none can end silently while its streams wait and its heartbeats go on."""
    try:
        while True:
            await iterate()
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        die(exc)
