"""KV events: which block hashes entered and left a worker's prefix cache since the last drain.

The block manager records them; a worker drains them in batches and publishes them to the
cluster prefix index (the router's "which worker holds this prefix" map). Within a batch the
last operation on a hash wins, which is exactly the state a per-worker set needs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine.block_hash import BlockHash


class CacheTier(enum.Enum):
    """Where a worker holds a block: reused as is, or copied back in first (cheaper than a
    recompute, dearer than a device hit)."""

    DEVICE = "device"
    HOST = "host"


@dataclass(frozen=True)
class KVEvents:
    stored: list[BlockHash]
    removed: list[BlockHash]
    # The cache was cleared before ``stored``: consumers drop everything they had first.
    cleared: bool = False
    tier: CacheTier = CacheTier.DEVICE

    @property
    def empty(self) -> bool:
        return not (self.stored or self.removed or self.cleared)


class KVEventLog:
    def __init__(self) -> None:
        self._present: dict[BlockHash, bool] = {}
        self._cleared = False

    def stored(self, block_hash: BlockHash) -> None:
        self._present[block_hash] = True

    def removed(self, block_hash: BlockHash) -> None:
        self._present[block_hash] = False

    def cleared(self) -> None:
        self._present.clear()
        self._cleared = True

    def drain(self, tier: CacheTier = CacheTier.DEVICE) -> KVEvents:
        events = KVEvents(
            stored=[h for h, present in self._present.items() if present],
            removed=[h for h, present in self._present.items() if not present],
            cleared=self._cleared,
            tier=tier,
        )
        self._present, self._cleared = {}, False
        return events
