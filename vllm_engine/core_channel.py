"""What the scheduler half of pdserve's connector tells the worker's front-end about a request's
blocks (``vllm_engine/connector.py``), wherever vLLM's engine core runs.

- In the worker's process (``VllmEngineCore.WORKER``) it is the engine's ``Bridge`` itself.
- In a process of its own (``VllmEngineCore.PROCESS``) it is ``HubChannel``: the same calls as
  messages to the front-end's hub (``proto/pdserve/v1/engine_hub.proto``: ``Allocated``,
  ``Pinned``), which hands them to the front-end's bridge. The engine core's busy loop never
  waits for them: a thread of its own sends them, in order.

The scheduler half keeps "a request loads at most once" itself (``LoadOnce``): after a
preemption vLLM recomputes it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from abc import ABC, abstractmethod

import grpc

from pdserve.v1 import engine_hub_pb2 as hub_pb2
from pdserve.v1 import engine_hub_pb2_grpc as hub_grpc

logger = logging.getLogger(__name__)

HUB_CALL_TIMEOUT_S = 10.0
PARENT_POLL_S = 0.5


class CoreChannel(ABC):
    """Called by the scheduler half of the connector, in vLLM's step (its engine core's thread);
    never blocks it on the front-end."""

    @abstractmethod
    def should_load(self, rid: str) -> bool:
        """Whether ``rid``'s remote KV is still to be loaded (not allocated before)."""

    @abstractmethod
    def allocated(
        self, rid: str, attempt: int, internal_id: str, block_ids: list[int], waits: bool
    ) -> None:
        """vLLM allocated the blocks of ``rid``'s add number ``attempt``; ``waits``: it parked
        the request until told its load finished (else its own prefix cache held every block,
        and it must not be told)."""

    @abstractmethod
    def pin(self, rid: str, attempt: int, internal_id: str, block_ids: list[int]) -> None:
        """A prefill (``rid``'s add number ``attempt``) finished: vLLM keeps its blocks until
        every rank reports it sent."""

    def finished(self, rid: str) -> None:
        """vLLM is done with ``rid`` (finished or aborted)."""
        return None

    def seen(self, finished_sending: set[str], finished_recving: set[str]) -> None:
        """vLLM's scheduler got these reports from every rank."""
        return None


class HubChannel(CoreChannel):
    """The engine core's end, in its own process: ``Allocated``/``Pinned`` to the hub."""

    def __init__(self, hub_address: str) -> None:
        self._loading: set[str] = set()  # allocated once; dropped when vLLM is done with it
        self._outbox: queue.SimpleQueue[tuple[str, hub_pb2.CoreBlocks] | None] = queue.SimpleQueue()
        self._channel = grpc.insecure_channel(hub_address)
        self._hub = hub_grpc.EngineHubStub(self._channel)
        self._thread = threading.Thread(target=self._send, name="pdserve-core-hub", daemon=True)
        self._thread.start()
        threading.Thread(
            target=_exit_with_parent, args=(os.getppid(),), name="pdserve-core-parent", daemon=True
        ).start()

    def should_load(self, rid: str) -> bool:
        return rid not in self._loading

    def allocated(
        self, rid: str, attempt: int, internal_id: str, block_ids: list[int], waits: bool
    ) -> None:
        self._loading.add(rid)
        blocks = hub_pb2.CoreBlocks(
            request_id=rid,
            attempt=attempt,
            internal_id=internal_id,
            block_ids=block_ids,
            waits=waits,
        )
        self._outbox.put(("Allocated", blocks))

    def pin(self, rid: str, attempt: int, internal_id: str, block_ids: list[int]) -> None:
        blocks = hub_pb2.CoreBlocks(
            request_id=rid, attempt=attempt, internal_id=internal_id, block_ids=block_ids
        )
        self._outbox.put(("Pinned", blocks))

    def finished(self, rid: str) -> None:
        self._loading.discard(rid)

    def close(self) -> None:
        self._outbox.put(None)
        self._thread.join(HUB_CALL_TIMEOUT_S)
        self._channel.close()

    def _send(self) -> None:
        while (item := self._outbox.get()) is not None:
            method, blocks = item
            try:
                getattr(self._hub, method)(blocks, timeout=HUB_CALL_TIMEOUT_S)
            except grpc.RpcError as exc:
                # The front-end is gone or stuck past the bound, or failed to take it: a lost
                # allocation or pin would hold vLLM's blocks for ever, so this engine core
                # (and with it its ranks) stops, and its worker with it (fail-stop).
                logger.error("pdserve hub: %s of %s failed: %s", method, blocks.request_id, exc)
                os._exit(1)


def _exit_with_parent(parent: int) -> None:
    """vLLM's engine core does not watch the process that started it (the worker's
    front-end): when that one dies (kill -9), this process and so its ranks (vLLM's executor
    ties them to it) must not outlive it. A poll, not PR_SET_PDEATHSIG: that fires when the
    parent's *thread* ends, and the front-end builds vLLM from a thread that does."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    logger.error("pdserve: the worker (pid %d) is gone; vLLM's engine core exits", parent)
    os._exit(1)
