"""Which full blocks the host-memory tier holds, and where (pure Python, no torch).

A fixed number of host slots, keyed by block hash, least recently used first out. The engine's
host tier (``native_engine/host_tier.py``) copies the bytes; this decides which slot. KV events of
this tier are recorded apart from the device cache's, so a cluster index can tell them apart.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import NamedTuple

from engine.block_hash import BlockHash
from engine.kv_events import KVEventLog


class FreedBlock(NamedTuple):
    """A device block that became cached-free: the host tier copies it (``HostTier.store``)."""

    block_id: int
    block_hash: BlockHash
    parent: BlockHash  # the block before it in its prompt (b"" for the prompt's first)
    head: BlockHash  # its prompt's first block: a KV store places a prefix by it


class Evicted(NamedTuple):
    """A block the host tier gave up (its slot is reused): spilled to a KV store, if any."""

    block_hash: BlockHash
    slot: int
    parent: BlockHash
    head: BlockHash


class HostIndex:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the host tier needs >= 1 slot, got {num_slots}")
        self.num_slots = num_slots
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()  # LRU first
        self._free = list(range(num_slots - 1, -1, -1))  # slot 0 handed out first
        self.kv_events = KVEventLog()
        self.num_evicted = 0
        self._lineage: dict[BlockHash, tuple[BlockHash, BlockHash]] = {}  # hash -> parent, head
        self.evicted: list[Evicted] = []  # since the last ``take_evicted``

    @property
    def num_used(self) -> int:
        return len(self._slots)

    def check(self) -> None:
        """Raise unless every slot is either held by one hash or free (tests)."""
        held = sorted(self._slots.values())
        if sorted(held + self._free) != list(range(self.num_slots)):
            raise AssertionError(f"host slots inconsistent: {held} held, {self._free} free")

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slots

    def hashes(self) -> list[BlockHash]:
        return list(self._slots)

    def lookup(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Slots of the longest run of ``block_hashes`` held here, from its start (each made
        most recently used)."""
        slots: list[int] = []
        for block_hash in block_hashes:
            slot = self._slots.get(block_hash)
            if slot is None:
                break
            self._slots.move_to_end(block_hash)
            slots.append(slot)
        return slots

    def take_evicted(self) -> list[Evicted]:
        evicted, self.evicted = self.evicted, []
        return evicted

    def reserve(
        self,
        block_hash: BlockHash,
        protected: Collection[int] = (),
        lineage: tuple[BlockHash, BlockHash] = (b"", b""),
    ) -> int | None:
        """The slot to copy a block with this hash into; None when it is held already (then
        it is made most recently used) or when every slot is ``protected`` (read by a copy
        queued after this one: it must not be overwritten first). A full pool gives up its
        least recently used unprotected slot (listed in ``evicted``). ``lineage``: the block's
        parent and its prompt's first block."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._slots.items() if s not in protected), None)
            if victim is None:
                return None
            slot = self._slots.pop(victim)
            self.kv_events.removed(victim)
            self.num_evicted += 1
            self.evicted.append(Evicted(victim, slot, *self._lineage.pop(victim, (b"", b""))))
        self._slots[block_hash] = slot
        self._lineage[block_hash] = lineage
        self.kv_events.stored(block_hash)
        return slot
