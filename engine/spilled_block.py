"""A block a worker's last cache tier gave up, with its bytes: what it offloads to a KV store
(``ServingEngine.spill_evicted``; docs/kv-cache.md, "The store")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.block_hash import BlockHash


@dataclass(frozen=True)
class SpilledBlock:
    block_hash: BlockHash
    parent: BlockHash  # the block before it in its prompt (b"" for a prompt's first block)
    head: BlockHash  # its prompt's first block: a store places a whole prefix by it
    data: bytes  # layer-major slabs, as the engine's KV layout stores them


# Called from the engine's own threads: it must only hand the blocks over (a queue), never block.
SpillSink = Callable[[list[SpilledBlock]], None]
