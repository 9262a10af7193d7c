"""A sequence as the native engine schedules it: the contract's ``Sequence`` with its KV pages
(block table, block hashes, what is published to the prefix cache), how much of it is computed,
and the native prefill-only and prompt-logprobs progress."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.block_hash import BlockHash, hash_blocks
from engine.sequence import Sequence, SequenceStatus


@dataclass(eq=False)
class PagedSequence(Sequence):
    block_table: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache (prefix hits included).
    num_computed_tokens: int = 0
    # Chained hashes of every full block of token_ids (computed eagerly as tokens arrive).
    block_hashes: list[BlockHash] = field(default_factory=list)
    # Blocks of block_table already published to the prefix cache.
    num_registered_blocks: int = 0
    # block_table[0] is the prompt's block number block_offset (a lent prefix's run starts
    # where the puller's own cache ends: native_engine/prefix_share.py); 0 otherwise.
    block_offset: int = 0
    # Prefill-only requests keep their blocks pinned after the first token (disaggregation).
    prefill_only: bool = False
    # ``params.prompt_logprobs`` on the engine that prefills the client's prompt (not a
    # continuation's): ``prompt_logprobs`` is filled as the prefill runs.
    wants_prompt_logprobs: bool = False

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs still to compute: no prefix-cache hit may skip their positions."""
        return self.wants_prompt_logprobs and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def num_prompt_tokens_in(self, num_new_tokens: int) -> int:
        """How many of the next ``num_new_tokens`` tokens to compute are prompt tokens."""
        done = min(self.num_prompt_tokens, self.num_computed_tokens + num_new_tokens)
        return max(0, done - self.num_computed_tokens)

    def update_block_hashes(self, root: BlockHash, block_size: int) -> None:
        """Extend ``block_hashes`` to cover every full block of ``token_ids``."""
        if len(self.token_ids) // block_size <= len(self.block_hashes):
            return
        parent = self.block_hashes[-1] if self.block_hashes else None
        self.block_hashes.extend(
            hash_blocks(root, self.token_ids, block_size, len(self.block_hashes), parent)
        )

    def reset_for_recompute(self) -> None:
        """Preempted: its blocks are gone; prompt and outputs so far are recomputed later."""
        self.block_table = []
        self.num_computed_tokens = 0
        self.num_registered_blocks = 0
        self.status = SequenceStatus.WAITING
