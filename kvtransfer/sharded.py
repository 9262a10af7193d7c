"""Which sender and receiver a worker's engine gets: from the engine itself (a tensor-parallel
engine), or the backend's over its pages.

The one rule, for the prefill service, the decode service and the capacity profiler: a
``ShardedKV`` engine (vLLM) hands out its own: facades whose ranks each move their own shard
(``vllm_engine/rank_transfer.py``), or at tensor_parallel_size 1 a receiver that maps a prefill
engine's shards of any tensor parallelism to its pages (``kvtransfer/shard_receiver.py``); an
engine with ``kv_pages`` (the native engine) moves KV through the backend over those pages; any
other engine exchanges no KV.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from kvtransfer.base import BlockLeases, KVReceiver, KVSender

if TYPE_CHECKING:
    from engine.serving_engine import ServingEngine
    from kvtransfer import ReceiverOptions, SenderOptions


class ShardedKV(ABC):
    """An engine whose KV cache is tensor-parallel shards: in its ranks' processes, or here
    with a receiver that maps another tensor parallelism's shards. Called by
    ``engine_sender``/``engine_receiver`` only, once per worker, before the first request; the
    worker service owns (starts, stops, closes) what they return."""

    @abstractmethod
    def make_kv_sender(
        self, backend: str, leases: BlockLeases, options: SenderOptions
    ) -> KVSender: ...

    @abstractmethod
    def make_kv_receiver(self, backend: str, options: ReceiverOptions) -> KVReceiver: ...


def engine_sender(
    engine: ServingEngine, backend: str, leases: BlockLeases, options: SenderOptions
) -> KVSender:
    from kvtransfer import make_sender

    if isinstance(engine, ShardedKV):
        return engine.make_kv_sender(backend, leases, options)
    pages = engine.kv_pages
    if pages is not None:
        return make_sender(backend, pages, leases, options)
    raise ValueError("this worker's engine exchanges no KV: it cannot serve prefill handles")


def engine_receiver(
    engine: ServingEngine, backend: str, options: ReceiverOptions
) -> KVReceiver | None:
    """None: the engine takes no remote KV (it serves colocated requests only)."""
    from kvtransfer import make_receiver

    if isinstance(engine, ShardedKV):
        return engine.make_kv_receiver(backend, options)
    pages = engine.kv_pages
    if pages is not None:
        return make_receiver(backend, pages, options)
    return None
