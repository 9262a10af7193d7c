"""The native engine's side of a peer pull (docs/kv-cache.md): cached prefix blocks lent to
another engine, and blocks borrowed from one into this engine's prefix cache. Who calls what
and who frees what is the contract in ``kvtransfer/base.py`` ("Peer pull"); here is only what
each call does to the blocks. Every call runs between steps (``AsyncEngine.call``).

The holder:
- ``lend(lease_id, token_ids, first_block, num_blocks)`` takes a reference on each of its
  cached blocks ``[first_block, n)`` of the prefix ``token_ids`` starts with, ``n`` the run
  cached from block 0 (device, then host tier), at most ``num_blocks``, and lists them in the
  engine's ``pinned`` under ``lease_id``. Blocks of the run in the host tier are copied into
  fresh device blocks first (``Lent.copy``: nothing reads them before it lands). From there
  the lease is a pinned request's: the KV sender reads the blocks, ``free_pinned`` drops the
  references, exactly once. A lent block is never evicted while referenced; concurrent leases
  of one block share it (a reference each).

The puller:
- ``borrow(borrow_id, token_ids, num_blocks)`` takes a reference on the blocks of that prefix
  it holds already (the first ``h``), allocates the rest, and says which blocks to write.
- ``landed(borrow_id, n)``: the receiver wrote the first ``n`` of them; those join the prefix
  cache under the puller's own hashes of the same tokens (one hasher, one model fingerprint:
  the same blocks). A holder may lend fewer than asked: the rest stay unpublished.
- ``give_back(borrow_id)`` drops every reference, landed or not (a failed pull's blocks were
  never published: they go back unhashed). The caller gives back once the request that needed
  them has been admitted, so eviction cannot take them in between.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from engine.block_hash import BlockHash
from engine.sampling_params import SamplingParams
from engine.serving_engine import PeerPullUnsupported
from native_engine.llm_engine import LLMEngine
from native_engine.paged_sequence import PagedSequence

_PARAMS = SamplingParams(max_tokens=1)  # a lease or a borrow is blocks, not a request


@dataclass(frozen=True)
class Lent:
    """Blocks pinned for a lease, in order; ``copy``: the host-tier copy into the last
    ``num_from_host`` of them, which must land before any is read (None: none)."""

    block_ids: list[int]
    copy: Future[None] | None = None
    num_from_host: int = 0


@dataclass(frozen=True)
class Borrowed:
    """Blocks ``[first_block, first_block + len(block_ids))`` of the prefix are to be written
    into ``block_ids``; the first ``first_block`` are cached here already."""

    first_block: int
    block_ids: list[int]


class PrefixShare:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.borrowed: dict[str, PagedSequence] = {}
        self.num_lent_blocks = 0  # over the engine's life, as counters
        self.num_borrowed_blocks = 0  # landed

    def lend(self, lease_id: str, token_ids: list[int], first_block: int, num_blocks: int) -> Lent:
        """The blocks lent (none: nothing of it is cached past ``first_block``, and nothing
        is pinned), and the copy to wait for before any is read, when the run continues in
        the host tier. Raises ValueError for a lease id in use or ids out of the vocabulary."""
        engine, manager = self.engine, self.engine.block_manager
        engine.check_new_request(lease_id)
        if not manager.enable_prefix_caching:
            raise PeerPullUnsupported("nothing is lent from a cache without prefix caching")
        if first_block < 0:
            raise ValueError(f"first_block must be >= 0, got {first_block}")
        seq = self._sequence(lease_id, token_ids, num_blocks)
        if seq is None:
            return Lent([])
        hits = manager.find_cached_prefix(seq.block_hashes, num_blocks)
        seq.block_offset = first_block
        host = self._host_run(seq, len(hits), num_blocks)[max(0, first_block - len(hits)) :]
        device = hits[first_block:]
        size = engine.block_size
        if not host or not manager.allocate_slots(seq, len(host) * size, device):
            host = []  # no room to copy the host run in: the device run alone
            if not device:
                return Lent([])
            referenced = manager.allocate_slots(seq, 0, device)
            assert referenced  # references only: no room needed
        copy = None
        if host:
            pairs = list(zip(host, seq.block_table[len(device) :], strict=True))
            assert engine.host_loads is not None and engine.host_tier is not None
            try:
                # Pending stores into the fresh blocks finish first; the slots read are kept.
                engine.host_loads.sync(protected=set(host))
                copy = engine.host_tier.load(pairs)
            except BaseException:
                manager.free(seq)
                raise
        engine.pinned[lease_id] = seq
        self.num_lent_blocks += len(seq.block_table)
        return Lent(list(seq.block_table), copy, len(host))

    def _host_run(self, seq: PagedSequence, num_device: int, num_blocks: int) -> list[int]:
        """Host-tier slots of the blocks right after the device run, as far as it holds them."""
        index = self.engine.block_manager.host_index
        return index.lookup(seq.block_hashes[num_device:num_blocks]) if index is not None else []

    def borrow(self, borrow_id: str, token_ids: list[int], num_blocks: int) -> Borrowed | None:
        """Room for the prefix's first ``num_blocks`` blocks: None when the cache has none
        (nothing held); nothing to write when they are all cached here (nothing held)."""
        engine, manager = self.engine, self.engine.block_manager
        if borrow_id in self.borrowed:
            raise ValueError(f"borrow id {borrow_id!r} is in use")
        if not manager.enable_prefix_caching:
            raise PeerPullUnsupported("a peer pull lands in the prefix cache, which is off here")
        seq = self._sequence(borrow_id, token_ids, num_blocks)
        if seq is None:
            return Borrowed(0, [])
        num_blocks = len(seq.block_hashes)
        hits = manager.find_cached_prefix(seq.block_hashes, num_blocks)
        missing = num_blocks - len(hits)
        if missing <= 0:
            return Borrowed(len(hits), [])
        if not manager.allocate_slots(seq, missing * engine.block_size, hits):
            return None
        try:
            engine.sync_host_tier()  # the receiver writes these blocks from its own thread
        except BaseException:
            manager.free(seq)
            raise
        self.borrowed[borrow_id] = seq
        return Borrowed(len(hits), seq.block_table[len(hits) :])

    def landed(self, borrow_id: str, num_written: int) -> list[BlockHash]:
        """The first ``num_written`` blocks to write are written (a holder may lend fewer than
        asked; 0: the pull failed): they join the prefix cache, and the rest go back at once
        (never hashed): held until the request is done, they could keep a full cache from
        ever seating it. Returns the hashes newly cached."""
        seq = self.borrowed[borrow_id]
        size = self.engine.block_size
        first = seq.num_computed_tokens // size
        if not 0 <= num_written <= len(seq.block_table) - first:
            raise ValueError(f"num_written must be in [0, {len(seq.block_table) - first}]")
        seq.num_computed_tokens = (first + num_written) * size
        self.num_borrowed_blocks += num_written
        manager = self.engine.block_manager
        cached = manager.register_computed_blocks(seq)
        manager.trim(seq, seq.num_computed_tokens)
        return cached

    def give_back(self, borrow_id: str) -> None:
        """Drops the borrow's references (a no-op when it holds none)."""
        seq = self.borrowed.pop(borrow_id, None)
        if seq is not None:
            self.engine.block_manager.free(seq)

    def _sequence(self, seq_id: str, token_ids: list[int], num_blocks: int) -> PagedSequence | None:
        """The prefix's whole blocks, hashed (at most ``num_blocks``; None: not one), its ids
        checked (ValueError)."""
        engine = self.engine
        num_blocks = min(num_blocks, len(token_ids) // engine.block_size)
        if num_blocks <= 0:
            return None
        prefix = token_ids[: num_blocks * engine.block_size]
        seq = engine.intake.sequence(PagedSequence, seq_id, prefix, _PARAMS)
        seq.update_block_hashes(engine.loaded.root_hash, engine.block_size)
        return seq
