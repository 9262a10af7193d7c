"""vLLM's KV cache events as pdserve's prefix-index events.

vLLM publishes which blocks entered (with their token ids) and left its prefix cache, named by
its own block hashes. The router looks prefixes up by pdserve's hashes (``engine.block_hash``,
seeded by the worker's fingerprint): there is one hasher, so each stored block is rehashed
here from its tokens, chained from its parent's pdserve hash, and vLLM's hash only names the
block for its removal. A block whose parent this engine never saw stored cannot be named in
pdserve's chain: it is left out (its prefix is not routable to this worker, which is safe).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

import msgspec
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventPublisher,
    KVEventBatch,
)

from engine.block_hash import BlockHash, hash_block
from engine.kv_events import KVEventLog, KVEvents

logger = logging.getLogger(__name__)


class BufferingPublisher(EventPublisher):
    """What vLLM's scheduler publishes to (its step thread): batches kept for the engine. vLLM
    knows only its own publishers by name, so the engine installs this one in place of the
    null publisher vLLM was configured with."""

    def __init__(self, data_parallel_rank: int = 0, **_config: Any) -> None:
        super().__init__(data_parallel_rank)
        self._lock = threading.Lock()
        self._batches: list[EventBatch] = []

    def publish(self, events: EventBatch) -> None:
        with self._lock:
            self._batches.append(events)

    def take(self) -> list[EventBatch]:
        with self._lock:
            batches, self._batches = self._batches, []
            return batches

    def shutdown(self) -> None:
        return None


class CachedBlocks:
    """The pdserve hashes of every block in vLLM's prefix cache, kept from its events."""

    def __init__(self, root: BlockHash) -> None:
        self._root = root
        self._ours: dict[Any, BlockHash] = {}  # vLLM's block hash -> pdserve's
        self.log = KVEventLog()

    def apply(self, batches: Iterable[EventBatch]) -> None:
        for batch in batches:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    self._stored(event)
                elif isinstance(event, BlockRemoved):
                    for vllm_hash in event.block_hashes:
                        ours = self._ours.pop(vllm_hash, None)
                        if ours is not None:
                            self.log.removed(ours)
                elif isinstance(event, AllBlocksCleared):
                    self._ours.clear()
                    self.log.cleared()

    def _stored(self, event: BlockStored) -> None:
        if event.parent_block_hash is None:
            parent: BlockHash | None = self._root
        else:
            parent = self._ours.get(event.parent_block_hash)
        size = event.block_size
        for i, vllm_hash in enumerate(event.block_hashes):
            if parent is None:
                return
            tokens = event.token_ids[i * size : (i + 1) * size]
            if len(tokens) < size:
                return
            parent = hash_block(parent, tokens)
            self._ours[vllm_hash] = parent
            self.log.stored(parent)

    def hashes(self) -> list[BlockHash]:
        return list(self._ours.values())

    def drain(self) -> KVEvents:
        return self.log.drain()


class EventSubscriber:
    """vLLM's KV cache events from an engine core in a process of its own: a SUB socket on its
    ZMQ publisher (``kv_events_config``, an ``ipc://`` endpoint in a directory only this user
    may enter), read on the event loop. Each message is ``(topic, seq, msgpack batch)``; a
    sequence gap (the publisher's queue overflowed) is logged and clears the index (a lost
    removal must not leave a hash there): it then holds the blocks stored after the gap whose
    parents it saw (``CachedBlocks``), which is safe: a prefix it misses is not routed here."""

    def __init__(self, endpoint: str) -> None:
        import zmq
        import zmq.asyncio

        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(endpoint)  # before vLLM binds: ZMQ connects once it does
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._batches: list[EventBatch] = []
        self._next_seq: int | None = None

    async def run(self) -> None:
        while True:
            _topic, seq_bytes, payload = await self._socket.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if self._next_seq is not None and seq != self._next_seq:
                # A lost removal would leave a hash in the index for ever: start it afresh.
                logger.warning("vLLM KV events %d..%d were lost", self._next_seq, seq - 1)
                self._batches.append(KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
            self._next_seq = seq + 1
            self._batches.append(self._decoder.decode(payload))

    def take(self) -> list[EventBatch]:
        batches, self._batches = self._batches, []
        return batches

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()
