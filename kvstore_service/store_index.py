"""Which blocks a KV store holds, in which slot, and which one goes when it is full (pure
Python, no torch; exact-value tests in ``tests/unit/test_store_index.py``).

A fixed number of slots keyed by block hash (``engine/block_hash.py``). Eviction is least
recently used *and prefix-aware*: only a block no other held block continues (a leaf of the
prefix tree the store holds) and no lease pins may go. A prompt's blocks are found from its
first one onwards, so evicting a head would strand every block after it; taking the tail first
keeps what is left of a prefix usable. A lookup makes the whole run it finds most recently
used.

Callers (the store's service, on its event loop): ``admit`` for each offloaded block, then the
bytes are written into the slot before any await (nobody can lend a slot between the two);
``run`` and ``pin`` for a ``LeasePrefix``; ``unpin`` once that lease is freed.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engine.block_hash import BlockHash
from engine.kv_events import KVEventLog


@dataclass
class _Entry:
    slot: int
    parent: BlockHash  # b"": a prompt's first block
    refs: int = 0  # leases pinning it


class StoreIndex:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a KV store needs >= 1 slot, got {num_slots}")
        self.num_slots = num_slots
        self._entries: OrderedDict[BlockHash, _Entry] = OrderedDict()  # least recent first
        self._free = list(range(num_slots - 1, -1, -1))  # slot 0 handed out first
        # Held blocks per parent hash, whether the parent is held or not: blocks arrive tail
        # first (a worker evicts a prompt's tail first), so a child often comes before its
        # parent, which must count it when it comes.
        self._children: Counter[BlockHash] = Counter()
        self.kv_events = KVEventLog()
        self.num_stored = 0
        self.num_evicted = 0
        self.num_refused = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._entries

    def hashes(self) -> list[BlockHash]:
        return list(self._entries)

    def slot(self, block_hash: BlockHash) -> int:
        return self._entries[block_hash].slot

    @property
    def num_pinned(self) -> int:
        return sum(e.refs > 0 for e in self._entries.values())

    def admit(self, block_hash: BlockHash, parent: BlockHash) -> int | None:
        """The slot to write a new block into; None when it is held already (then made most
        recently used) or no slot can be freed (every leaf pinned: counted refused)."""
        entry = self._entries.get(block_hash)
        if entry is not None:
            self._entries.move_to_end(block_hash)
            return None
        slot = self._free.pop() if self._free else self._evict()
        if slot is None:
            self.num_refused += 1
            return None
        self._entries[block_hash] = _Entry(slot, parent)
        if parent:
            self._children[parent] += 1
        self.kv_events.stored(block_hash)
        self.num_stored += 1
        return slot

    def run(self, block_hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """The longest run of ``block_hashes`` held here from its first, each made most
        recently used (the run's head last: of two leaves, the deeper is older)."""
        found: list[BlockHash] = []
        for block_hash in block_hashes:
            if block_hash not in self._entries:
                break
            found.append(block_hash)
        for block_hash in reversed(found):
            self._entries.move_to_end(block_hash)
        return found

    def pin(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """One reference more on each (held) block: none is evicted until ``unpin``. Their
        slots, in order."""
        entries = [self._entries[h] for h in block_hashes]
        for entry in entries:
            entry.refs += 1
        return [e.slot for e in entries]

    def unpin(self, block_hashes: Sequence[BlockHash]) -> None:
        for block_hash in block_hashes:
            entry = self._entries[block_hash]
            if entry.refs < 1:
                raise AssertionError(f"block {block_hash.hex()} unpinned more than pinned")
            entry.refs -= 1

    def _evict(self) -> int | None:
        # A scan from the least recently used end; leaves are usually near it (a lookup
        # makes a run's head the most recent).
        victim = next(
            (h for h, e in self._entries.items() if e.refs == 0 and not self._children[h]),
            None,
        )
        if victim is None:
            return None
        entry = self._entries.pop(victim)
        if entry.parent:
            self._children[entry.parent] -= 1
            if not self._children[entry.parent]:
                del self._children[entry.parent]
        self.kv_events.removed(victim)
        self.num_evicted += 1
        return entry.slot

    def check(self) -> None:
        """Raise unless every slot is held by one hash or free, and the counts add up (tests)."""
        held = sorted(e.slot for e in self._entries.values())
        if sorted(held + self._free) != list(range(self.num_slots)):
            raise AssertionError(f"store slots inconsistent: {held} held, {self._free} free")
        counted = Counter(e.parent for e in self._entries.values() if e.parent)
        if counted != self._children or any(e.refs < 0 for e in self._entries.values()):
            raise AssertionError("store child or reference counts inconsistent")
