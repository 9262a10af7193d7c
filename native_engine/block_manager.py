"""Ownership of KV cache blocks: free list, ref counts, and the prefix cache.

Pure Python (no torch), so it can be unit-tested with exact values and reasoned about alone.

Contract (who frees which block, when):
- A block's only owner is this manager; sequences hold references, counted in ``ref_count``.
- ``allocate_slots`` takes references for a sequence (new blocks and prefix-cache hits);
  ``free`` drops every reference the sequence holds, exactly once, and empties its block table.
- A block whose count drops to zero goes to the free queue. If it holds a full, hashed block it
  stays findable in the prefix cache until the free queue hands it out again (LRU eviction):
  "free" and "cached" are not exclusive. Unhashed free blocks are handed out first.
- Invariant after all work drains: every block has ``ref_count == 0`` and sits in the free queue
  (``check_no_leaks``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from engine.block_hash import BlockHash
from engine.kv_events import KVEventLog
from native_engine.host_index import FreedBlock, HostIndex
from native_engine.paged_sequence import PagedSequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        host_index: HostIndex | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Eviction order: first key is handed out first.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self.num_evicted_blocks = 0
        self.kv_events = KVEventLog()
        # The host tier (``native_engine/host_tier.py``): which hashes it holds, and the copy work
        # the engine owes it: blocks that became cached-free (to store) and blocks handed
        # out again (whose pending stores must finish before anything overwrites them).
        self.host_index = host_index
        self._to_store: list[FreedBlock] = []
        self._reused: list[int] = []

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, block_hashes: Seq[BlockHash], max_blocks: int) -> list[int]:
        """Block ids of the longest cached prefix of ``block_hashes`` (at most ``max_blocks``)."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for block_hash in block_hashes[:max_blocks]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def cached_prefix(self, seq: PagedSequence) -> list[int]:
        """Prefix-cache hits for a sequence about to be admitted.

        At least one token is always left to compute: its logits produce the next token.
        None while the prompt's logprobs are wanted: every position is computed.
        """
        if seq.needs_prompt_logprobs:
            return []
        return self.find_cached_prefix(seq.block_hashes, (seq.num_tokens - 1) // self.block_size)

    def host_prefix(self, seq: PagedSequence, num_device_hits: int) -> list[int]:
        """Host-tier slots of the blocks right after ``num_device_hits`` device hits, as far
        as the host tier holds them (leaving a token to compute, as ``cached_prefix`` does)."""
        if self.host_index is None or seq.needs_prompt_logprobs:
            return []
        end = (seq.num_tokens - 1) // self.block_size
        return self.host_index.lookup(seq.block_hashes[num_device_hits:end])

    def drain_to_store(self) -> list[FreedBlock]:
        """Blocks that became cached-free since the last drain, to copy."""
        work, self._to_store = self._to_store, []
        return work

    def drain_reused(self) -> list[int]:
        """Blocks handed out since the last drain (their pending copies must finish first)."""
        work, self._reused = self._reused, []
        return work

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(
        self, seq: PagedSequence, num_new_tokens: int, cached_block_ids: Seq[int] = ()
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``seq``, after ``cached_block_ids``.

        All or nothing: on False nothing changed. On True the cached blocks (which must extend
        the sequence's current table) and any new blocks are appended to its block table, and
        the cached tokens count as computed.
        """
        num_computed = seq.num_computed_tokens + len(cached_block_ids) * self.block_size
        total_blocks = self.blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = total_blocks - len(seq.block_table) - len(cached_block_ids)
        # Hits that sit in the free queue stop being free when touched.
        num_revived = sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)
        if max(num_new_blocks, 0) > self.num_free_blocks - num_revived:
            return False
        for block_id in cached_block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_computed_tokens = num_computed
        if cached_block_ids:
            # Hits are published already; only blocks computed from here on need registering.
            seq.num_registered_blocks = len(seq.block_table)
        for _ in range(num_new_blocks):
            seq.block_table.append(self._pop_free())
        return True

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if self.host_index is not None:
            self._reused.append(block_id)
        if block.block_hash is not None:
            # Evicted from the prefix cache: its contents are about to be overwritten.
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
                self.kv_events.removed(block.block_hash)
            block.block_hash = None
            self.num_evicted_blocks += 1
        block.ref_count = 1
        return block_id

    def register_computed_blocks(self, seq: PagedSequence) -> list[BlockHash]:
        """Publish the sequence's newly completed full blocks to the prefix cache.

        Returns the hashes newly stored (the KV events a cluster index consumes).
        """
        if not self.enable_prefix_caching:
            return []
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        stored: list[BlockHash] = []
        for i in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            block_hash = seq.block_hashes[i]
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block.block_id
                self.kv_events.stored(block_hash)
                stored.append(block_hash)
            # else: the same contents are already cached in another block; keep this one private.
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)
        return stored

    def stats_fields(self) -> dict[str, int]:
        """Its part of ``EngineStats``."""
        return {
            "num_blocks": self.num_blocks,
            "num_free_blocks": self.num_free_blocks,
            "num_cached_blocks": self.num_cached_blocks,
        }

    def free(self, seq: PagedSequence) -> None:
        """Drop the sequence's references. Tail blocks are queued for eviction before the head
        (heads are the prefixes other requests share); unhashed blocks are reused first."""
        for i in reversed(range(len(seq.block_table))):
            block_id = seq.block_table[i]
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed twice (request {seq.request_id})")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)
                elif self.host_index is not None:  # evictable from here on: keep a copy
                    n = seq.block_offset + i  # its block number in the prompt
                    parent = seq.block_hashes[n - 1] if n else b""
                    head = seq.block_hashes[0]
                    self._to_store.append(FreedBlock(block_id, block.block_hash, parent, head))
        seq.block_table = []
        seq.num_registered_blocks = 0

    def trim(self, seq: PagedSequence, num_tokens: int) -> None:
        """Give back the tail blocks ``seq`` holds beyond its first ``num_tokens`` tokens
        (speculative slots of rejected tokens). Such blocks were allocated for this step only:
        never hashed, never shared."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            if block.ref_count != 1 or block.block_hash is not None:
                raise RuntimeError(f"block {block.block_id} trimmed while shared or cached")
            block.ref_count = 0
            self._free[block.block_id] = None
            self._free.move_to_end(block.block_id, last=False)
        seq.num_registered_blocks = min(seq.num_registered_blocks, len(seq.block_table))

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (the blocks stay where they are)."""
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        self.kv_events.cleared()

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash in the prefix cache: the snapshot a worker publishes on (re)connect."""
        return list(self._cached)

    def check_no_leaks(self) -> None:
        """Raise if any block is still referenced; used by tests and on shutdown."""
        held = [b.block_id for b in self.blocks if b.ref_count != 0]
        if held or len(self._free) != self.num_blocks:
            raise AssertionError(
                f"leaked blocks: {len(held)} referenced ({held[:8]}...), "
                f"{self.num_blocks - len(self._free)} not in the free queue"
            )
