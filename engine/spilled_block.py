"""A block a worker's last cache tier gave up, with its bytes: what it offloads to a KV store
(``ServingEngine.spill_evicted``; docs/kv-cache.md, "The store")."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from engine.block_hash import BlockHash


@dataclass(frozen=True)
class SpilledBlock:
    block_hash: BlockHash
    parent: BlockHash  # the block before it in its prompt (b"" for a prompt's first block)
    head: BlockHash  # its prompt's first block: a store places a whole prefix by it
    data: bytes  # layer-major slabs, as the engine's KV layout stores them


class SpillSink(ABC):
    """Where an engine's spilled blocks go (a worker's ``StoreOffloader``). The engine calls
    both methods from its own threads (the host tier's copy thread): they only look at flags
    and hand over (a queue); neither may block."""

    @abstractmethod
    def wanted(self) -> bool:
        """Whether blocks are taken now (a store is known, the queue has room). False: the
        engine does not even read the evicted blocks out."""

    @abstractmethod
    def take(self, blocks: list[SpilledBlock]) -> None:
        """The blocks (their bytes copied out of the engine's memory: the sink owns them)."""


# The most blocks one KVStore.Offload call carries: the store refuses more, and a worker's
# offloader sends at most this many (docs/kv-cache.md, "The store").
MAX_BLOCKS_PER_OFFLOAD = 256
