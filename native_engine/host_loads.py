"""The engine's side of the host tier: the copy work it owes each step, and the requests
whose prefix is being copied in (``native_engine/host_tier.py`` owns the copies themselves).

``LLMEngine`` calls ``sync`` before anything may overwrite a block (a model step, a KV
receiver's writes), ``start`` with the scheduler's new loads, ``finish`` at the start of every
step, and ``abandon`` when a request is aborted: a loading request's blocks are freed only
once the copy into them has landed, and never by blocking the caller.
"""

from __future__ import annotations

from collections.abc import Collection
from concurrent.futures import Future

from native_engine.block_manager import BlockManager
from native_engine.host_tier import HostTier
from native_engine.paged_sequence import PagedSequence
from native_engine.scheduler import Scheduler


class HostLoads:
    def __init__(self, tier: HostTier, block_manager: BlockManager, scheduler: Scheduler) -> None:
        self.tier = tier
        self.block_manager = block_manager
        self.scheduler = scheduler
        self.loading: dict[str, tuple[PagedSequence, Future[None]]] = {}
        self.abandoned: list[tuple[PagedSequence, Future[None]]] = []  # freed once their copy lands

    def sync(self, protected: Collection[int] = ()) -> None:
        """Copies blocks that became cached-free to the host tier, then waits for pending
        copies of blocks handed out again (before anything overwrites them)."""
        self.store_freed(protected)
        self.tier.before_reuse(self.block_manager.drain_reused())

    def store_freed(self, protected: Collection[int] = ()) -> None:
        """Queues the copies of blocks that became cached-free (none waits)."""
        self.tier.store(self.block_manager.drain_to_store(), protected)

    def start(self, loads: list[tuple[PagedSequence, list[tuple[int, int]]]]) -> None:
        if not loads:
            return
        # Pending stores into the loads' target blocks finish first (they run before the
        # loads, in order); the slots the loads read are kept from being evicted by them.
        self.sync(protected={slot for _, pairs in loads for slot, _ in pairs})
        for seq, pairs in loads:
            self.loading[seq.request_id] = (seq, self.tier.load(pairs))

    def finish(self) -> None:
        """Requests whose blocks are in join the device prefix cache and take a seat;
        abandoned ones give their blocks back."""
        self.tier.raise_if_failed()
        for request_id, (seq, future) in list(self.loading.items()):
            if future.done():
                future.result()  # a failed copy is an engine failure, as a failed step is
                del self.loading[request_id]
                self.block_manager.register_computed_blocks(seq)
                self.scheduler.loaded(seq)
        for entry in [a for a in self.abandoned if a[1].done()]:
            self.abandoned.remove(entry)
            self.block_manager.free(entry[0])

    def abandon(self, request_id: str) -> bool:
        """The request was aborted: True if it was loading (its blocks are freed later)."""
        entry = self.loading.pop(request_id, None)
        if entry is not None:
            self.abandoned.append(entry)
        return entry is not None

    def pending(self) -> list[Future[None]]:
        return [f for _, f in self.loading.values()] + [f for _, f in self.abandoned]
