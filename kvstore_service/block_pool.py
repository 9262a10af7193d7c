"""A KV store's blocks: host-memory pages of the cluster's layout, the index of which block is in
which slot (``StoreIndex``), and the lends of pulls in flight.

Who calls what (the store's service, on its event loop; nothing here awaits):
- ``put`` for each offloaded block: the slot is chosen and the bytes written in one call, so no
  lease can read a slot between the two;
- ``lend`` for a ``LeasePrefix``: the run it finds is pinned under the lease id; the service's
  lease manager calls ``free_pinned`` exactly once per lease (released, expired, or the store
  stopping), which unpins it;
- the KV sender reads pinned slots (its ``BlockLeases`` checkout names them).
A pinned block is never evicted or overwritten: the index picks only unpinned leaves.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.block_hash import BlockHash
from engine.kv_events import CacheTier, KVEvents
from engine.kv_layout import KVCacheLayout
from engine.page_tensor import PageTensor
from kvstore_service.store_index import StoreIndex


class BlockPool:
    def __init__(self, layout: KVCacheLayout, capacity_bytes: int) -> None:
        num_slots = capacity_bytes // layout.block_bytes
        if num_slots < 1:
            raise ValueError(
                f"capacity {capacity_bytes} bytes holds no block of {layout.block_bytes} bytes"
            )
        self.layout = layout
        self.pages = PageTensor(layout, num_slots, torch.device("cpu"))
        self.index = StoreIndex(num_slots)
        self._lent: dict[str, list[BlockHash]] = {}  # lease id -> the run it pins
        self.collect_kv_events = False  # set by the cluster membership when it publishes

    @property
    def num_slots(self) -> int:
        return self.index.num_slots

    def put(self, block_hash: BlockHash, parent: BlockHash, data: bytes) -> bool | None:
        """Stores one block's bytes (``layout.block_bytes``, layer-major slabs). True: stored;
        False: held already; None: refused (no slot can be freed)."""
        if len(data) != self.layout.block_bytes:
            raise ValueError(f"data is {len(data)} bytes, a block is {self.layout.block_bytes}")
        if block_hash in self.index:
            self.index.admit(block_hash, parent)  # made most recently used
            return False
        slot = self.index.admit(block_hash, parent)
        if slot is None:
            return None
        if not self.collect_kv_events:  # nobody publishes them (no Redis): keep none
            self.index.kv_events.drain()
        words = self.pages.words  # [layers, 2, slots, *slab]
        block = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(words.dtype)
        words[:, :, slot] = block.view(words.shape[0], words.shape[1], *words.shape[3:])
        return True

    def lend(self, lease_id: str, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Pins the run of ``block_hashes`` held here from the first (possibly none) under
        ``lease_id``; its slots, in order."""
        if lease_id in self._lent:
            raise ValueError(f"lease {lease_id!r} exists already")
        run = self.index.run(block_hashes)
        if not run:
            return []
        self._lent[lease_id] = run
        return self.index.pin(run)

    async def free_pinned(self, lease_id: str) -> None:
        """The lease manager's one free per lease."""
        run = self._lent.pop(lease_id, None)
        if run is not None:
            self.index.unpin(run)

    @property
    def num_lent(self) -> int:
        return len(self._lent)

    # ---- what the cluster membership publishes (pdserve/cluster/membership.py) -------------
    def take_kv_events(self) -> list[KVEvents]:
        """The store's blocks are indexed as its own cache (the device key of its id: the
        registry's role says it is a store)."""
        events = self.index.kv_events.drain(CacheTier.DEVICE)
        return [] if events.empty or not self.collect_kv_events else [events]

    async def snapshot_cached_hashes(self) -> dict[CacheTier, list[BlockHash]]:
        self.index.kv_events.drain()
        return {CacheTier.DEVICE: self.index.hashes()}
