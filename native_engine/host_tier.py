"""The host-memory KV tier: a fixed pool of host blocks and one copy thread.

Who calls what (``LLMEngine`` only, from its step loop and its hooks):
- ``store`` after blocks became cached-free on the device (their last reference dropped; they
  stay findable there until handed out again): each is copied to the host, once per hash,
  queued on the copy thread. ``HostIndex`` picks the slot (least recently used first out).
- ``before_reuse`` with the device blocks just handed out again (by the scheduler, a
  speculative fit, a decode reservation): it waits for their pending copies, so no step or
  transfer overwrites a block that is still being read. Usually they finished long ago.
- ``load`` with (host slot, device block) pairs of a prompt whose prefix missed the device
  cache but hit this tier: returns a future; the scheduler holds the request in ``loading``
  until it is done (the engine checks every step), so no step reads a block being written.
One thread runs every copy in order, so a load from a slot always follows the store that
filled it, and a store into an evicted slot always follows the loads queued before it.
On CUDA the copies run on their own stream (after the work queued so far on the compute
stream), pinned host memory; on CPU both tiers are DRAM: the gain is prompt tokens not
recomputed.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.config import CacheConfig
from engine.spilled_block import SpilledBlock, SpillSink
from native_engine.host_index import Evicted, FreedBlock, HostIndex
from native_engine.kv_cache import KVCache

logger = logging.getLogger(__name__)


class HostTier:
    def __init__(self, cache: KVCache, num_slots: int) -> None:
        self.cache = cache
        self.index = HostIndex(num_slots)
        # [layers, 2, num_blocks, *slab]: the cache as copies move it (int32 words if quantized)
        shape = cache.words.shape
        device = cache.tensor.device
        self.pool = torch.zeros(
            (num_slots, shape[0], shape[1], *shape[3:]),
            dtype=cache.words.dtype,
            pin_memory=device.type == "cuda",
        )  # [slots, layers, 2, *slab]
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kv-host-tier")
        self._stores: dict[int, Future[None]] = {}  # device block -> its pending copy out
        self._failure: BaseException | None = None
        self.num_stored_blocks = 0
        self.num_loaded_blocks = 0
        # Where the blocks this tier evicts go (a KV store), from the copy thread; None: dropped.
        self.spill: SpillSink | None = None

    def store(self, blocks: list[FreedBlock], protected: Collection[int] = ()) -> None:
        """``protected``: slots a load queued after these stores reads (never evicted here).
        The blocks evicted for them are read out (for ``spill``) before they are overwritten,
        but those evicted in this same call: their bytes never reached the pool."""
        self.raise_if_failed()
        pairs: dict[int, int] = {}  # slot -> the device block copied into it (the last one)
        spilled: list[Evicted] = []
        for b in blocks:
            slot = self.index.reserve(b.block_hash, protected, (b.parent, b.head))
            if slot is None:
                continue
            for e in self.index.take_evicted():
                # A slot filled earlier in this call (a tier smaller than the call) holds no
                # bytes of its evicted block yet: that copy is dropped, and nothing spilled.
                if pairs.pop(e.slot, None) is None:
                    spilled.append(e)
            pairs[slot] = b.block_id
        if self.spill is None or not self.spill.wanted():
            spilled = []
        if not pairs:
            return
        copies = [(block_id, slot) for slot, block_id in pairs.items()]
        ready = self._compute_done()
        future = self._thread.submit(self._copy_out, copies, ready, spilled)
        for block_id, _ in copies:
            self._stores[block_id] = future
        self.num_stored_blocks += len(copies)

    def raise_if_failed(self) -> None:
        """A store that failed left its hash indexed over stale bytes: the tier (and so the
        engine) is not to be trusted any more; the step that sees it fails."""
        if self._failure is not None:
            raise RuntimeError("a host-tier copy failed") from self._failure

    def before_reuse(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            future = self._stores.pop(block_id, None)
            if future is not None:
                future.result()  # a memcpy queued earlier: bounded by the copy itself

    def load(self, pairs: list[tuple[int, int]]) -> Future[None]:
        """Copies host slots into device blocks: ``[(slot, block_id), ...]``."""
        self.num_loaded_blocks += len(pairs)
        return self._thread.submit(self._copy_in, pairs)

    def stats_fields(self) -> dict[str, int]:
        """This tier's part of ``EngineStats``."""
        return {
            "num_host_blocks": self.index.num_slots,
            "num_host_cached_blocks": self.index.num_used,
            "num_host_stored_blocks": self.num_stored_blocks,
            "num_host_loaded_blocks": self.num_loaded_blocks,
            "num_host_evicted_blocks": self.index.num_evicted,
        }

    def close(self) -> None:
        self._thread.shutdown(wait=True)

    def _compute_done(self) -> torch.cuda.Event | None:
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        # The blocks' last writes are on the compute stream of the cache's device, before this.
        event.record(torch.cuda.current_stream(self.cache.tensor.device))
        return event

    def _copy_out(
        self,
        pairs: list[tuple[int, int]],
        ready: torch.cuda.Event | None,
        evicted: list[Evicted],
    ) -> None:
        try:
            if evicted and self.spill is not None:
                self._spill(self.spill, evicted)
            self._copy_out_now(pairs, ready)
        except BaseException as exc:
            self._failure = exc
            raise

    def _copy_out_now(self, pairs: list[tuple[int, int]], ready: torch.cuda.Event | None) -> None:
        slots = torch.tensor([s for _, s in pairs])
        if self._stream is None:
            blocks = torch.tensor([b for b, _ in pairs])
            self.pool[slots] = self.cache.words.index_select(2, blocks).movedim(2, 0)
            return
        assert ready is not None
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            blocks = torch.tensor([b for b, _ in pairs], device=self.cache.tensor.device)
            data = self.cache.words.index_select(2, blocks).movedim(2, 0).to("cpu")
        self.pool[slots] = data

    def _spill(self, spill: SpillSink, evicted: list[Evicted]) -> None:
        """A spill only saves a later recompute: its failure is logged, never the tier's."""
        try:
            spill.take(self._read_out(evicted))
        except Exception:
            logger.exception("spilling %d evicted host-tier blocks failed", len(evicted))

    def _read_out(self, evicted: list[Evicted]) -> list[SpilledBlock]:
        """The evicted blocks' bytes, before this copy overwrites their slots."""
        data = self.pool[torch.tensor([e.slot for e in evicted])]  # a copy
        raw = data.view(torch.uint8).reshape(len(evicted), -1).numpy()
        return [
            SpilledBlock(e.block_hash, e.parent, e.head, raw[i].tobytes())
            for i, e in enumerate(evicted)
        ]

    def _copy_in(self, pairs: list[tuple[int, int]]) -> None:
        slots = torch.tensor([s for s, _ in pairs])
        data = self.pool[slots].movedim(0, 2)  # [layers, 2, n, *slab]
        if self._stream is None:
            self.cache.words.index_copy_(2, torch.tensor([b for _, b in pairs]), data)
            return
        with torch.cuda.stream(self._stream):
            blocks = torch.tensor([b for _, b in pairs], device=self.cache.tensor.device)
            self.cache.words.index_copy_(2, blocks, data.to(self.cache.tensor.device))
            self._stream.synchronize()


def make_host_tier(cache_config: CacheConfig, cache: KVCache) -> HostTier | None:
    """The tier ``host_cache_gib`` asks for (None when 0): as many host blocks as fit."""
    if not cache_config.host_cache_gib:
        return None
    num_slots = int(cache_config.host_cache_gib * 2**30) // cache.layout.block_bytes
    if num_slots < 1:
        raise ValueError(
            f"host_cache_gib {cache_config.host_cache_gib} holds no block of "
            f"{cache.layout.block_bytes} bytes"
        )
    return HostTier(cache, num_slots)
