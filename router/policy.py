"""Worker choice: pure functions over load snapshots (no I/O), unit-tested with exact values.

Least-loaded: fewest requests the router has in flight on the worker, then most free KV blocks,
then round-robin among equals so sequential requests spread too.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerLoad:
    address: str
    num_inflight: int  # requests this router has in flight there
    num_free_blocks: int  # from the worker's last stats
    num_blocks: int
    block_size: int = 16
    healthy: bool = True

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def _rank(workers: list[WorkerLoad], turn: int) -> list[WorkerLoad]:
    n = len(workers)
    order = {w.address: (i - turn) % n for i, w in enumerate(workers)} if n else {}
    return sorted(workers, key=lambda w: (w.num_inflight, -w.num_free_blocks, order[w.address]))


def rank_prefill(workers: list[WorkerLoad], turn: int = 0) -> list[str]:
    """Healthy prefill workers, best first."""
    return [w.address for w in _rank([w for w in workers if w.healthy], turn)]


def rank_decode(workers: list[WorkerLoad], num_prompt_tokens: int, turn: int = 0) -> list[str]:
    """Healthy decode workers that could ever hold the prompt, best first: those with enough
    free blocks now ahead of those that would have to free some first."""
    able = [w for w in workers if w.healthy and w.num_blocks >= w.blocks_for(num_prompt_tokens)]
    ranked = sorted(
        _rank(able, turn), key=lambda w: w.num_free_blocks < w.blocks_for(num_prompt_tokens)
    )
    return [w.address for w in ranked]
