"""Worker choice: pure functions over load snapshots (no I/O), unit-tested with exact values.

- ``round_robin``: healthy workers in turn.
- ``least_loaded``: fewest requests this router has in flight there, then most free KV blocks,
  then round-robin among equals so sequential requests spread too.
- ``cost`` (prefill): every option priced in seconds (``router/prefix_pricing.py``).
- ``cache_aware`` (prefill default): score = cached prompt tokens - alpha x queued prefill
  tokens, ties broken as least_loaded. Load-imbalance guard: a worker whose queued prefill
  tokens exceed the least-queued worker's by more than ``imbalance_tokens`` loses its cache
  credit (it competes on load alone). Under ordinary load the queues differ by far less than
  that, so the cache decides; the guard only stops a hot prefix from piling every request onto
  one worker while others idle.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from engine.kv_layout import KVCacheLayout
from engine.kv_shards import shard_mismatch


class RoutingPolicy(enum.Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    CACHE_AWARE = "cache_aware"
    # The cheapest of computing where the prefix is cached, pulling it from a peer, or
    # recomputing, priced in seconds (router/prefix_pricing.py; docs/kv-cache.md).
    COST = "cost"


# Decode placement follows free KV blocks; cache_aware is a prefill policy only.
DECODE_POLICIES = (RoutingPolicy.ROUND_ROBIN, RoutingPolicy.LEAST_LOADED)
# Consecutive timed-out stats calls after which a worker counts as stalled.
STALLED_AFTER_TIMEOUTS = 3


def is_stalled(
    num_stats_timeouts: int, record_expired: bool, limit: int = STALLED_AFTER_TIMEOUTS
) -> bool:
    """Whether a worker whose stats calls time out leaves routing. One slow answer is a busy
    worker (a long step), not a dead one; ``limit`` in a row is a stalled one, and so is one
    timeout once the worker's registry record has expired too (it stopped heartbeating)."""
    return num_stats_timeouts >= limit or (record_expired and num_stats_timeouts > 0)


def engine_stalled(engine_stalled_s: float, stall_timeout_s: float) -> bool:
    """Whether a worker that answers is stuck all the same: its engine has had work and
    completed no step for ``stall_timeout_s`` (a step blocked outside the GIL, as a hung device
    sync is: its heartbeats and stats answers go on). It leaves routing and its calls are
    given up on, like a worker that stopped answering (engine/step_progress.py)."""
    return engine_stalled_s >= stall_timeout_s


@dataclass(frozen=True)
class WorkerLoad:
    address: str
    num_inflight: int  # requests this router has in flight there
    num_free_blocks: int  # from the worker's last stats
    num_blocks: int
    block_size: int = 16
    routable: bool = True  # healthy, not suspected, draining or refused (Worker.routable)
    queued_prefill_tokens: int = 0  # uncached prompt tokens this router has sent, not yet done
    num_cached_blocks: int = 0  # from its last stats: blocks holding a prefix-cache entry
    stats_known: bool = True  # False until its first stats answer (sizes read 0 until then)
    # Its KV layout (its stats' rank 0's: tensor parallelism, heads per rank, page layout);
    # None until its stats come (then it counts as one rank).
    kv_layout: KVCacheLayout | None = None

    @property
    def tp_size(self) -> int:
        return self.kv_layout.tp_size if self.kv_layout is not None else 1

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_hold(self, num_tokens: int) -> bool:
        """Whether its whole cache could ever hold ``num_tokens`` of KV (a worker whose stats
        have not come yet reports 0 blocks: it cannot, as far as the router knows)."""
        return self.num_blocks >= self.blocks_for(num_tokens)


def takes_kv_of(decode: WorkerLoad, prefill: WorkerLoad) -> bool:
    """Whether a decode worker can take a prefill worker's KV shards: the decode worker's own
    rule (``engine.kv_shards.shard_mismatch``: the tensor parallelism maps, and the pages are
    the same arrangement, which for unequal sizes means cut by heads); until both stats came,
    by equal ``tp_size`` (as the two were started)."""
    if prefill.kv_layout is None or decode.kv_layout is None:
        return prefill.tp_size == decode.tp_size
    return shard_mismatch(prefill.kv_layout, decode.kv_layout) is None


def _rank(workers: list[WorkerLoad], turn: int) -> list[WorkerLoad]:
    n = len(workers)
    order = {w.address: (i - turn) % n for i, w in enumerate(workers)} if n else {}
    return sorted(workers, key=lambda w: (w.num_inflight, -w.num_free_blocks, order[w.address]))


def rank_prefill(workers: list[WorkerLoad], turn: int = 0) -> list[str]:
    """Healthy prefill workers, best first."""
    return [w.address for w in _rank([w for w in workers if w.routable], turn)]


def rank_decode(
    workers: list[WorkerLoad],
    num_prompt_tokens: int,
    turn: int = 0,
    policy: RoutingPolicy = RoutingPolicy.LEAST_LOADED,
) -> list[str]:
    """Healthy decode workers that could ever hold the prompt, best first (least-loaded or in
    turn), those with enough free blocks now ahead of those that would have to free some."""
    able = [w for w in workers if w.routable and w.can_hold(num_prompt_tokens)]
    if policy is RoutingPolicy.ROUND_ROBIN:
        by_address = {w.address: w for w in able}
        ordered = [by_address[a] for a in rank_round_robin(able, turn)]
    else:
        ordered = _rank(able, turn)
    ranked = sorted(ordered, key=lambda w: w.num_free_blocks < w.blocks_for(num_prompt_tokens))
    return [w.address for w in ranked]


def rank_round_robin(workers: list[WorkerLoad], turn: int = 0) -> list[str]:
    healthy = [w.address for w in workers if w.routable]
    if not healthy:
        return []
    k = turn % len(healthy)
    return healthy[k:] + healthy[:k]


# A block a worker holds only in its host tier is copied back, not recomputed: it is worth this
# share of a device hit in the cache-aware score (a copy costs far less than a prefill, but
# more than nothing).
HOST_HIT_CREDIT = 0.5


def host_credited_tokens(num_device_blocks: int, num_any_tier_blocks: int, block_size: int) -> int:
    """Cache credit, in tokens, of a worker holding ``num_device_blocks`` leading blocks in its
    device cache and ``num_any_tier_blocks`` in device and host tier together."""
    num_host = max(num_any_tier_blocks - num_device_blocks, 0)
    return int((num_device_blocks + HOST_HIT_CREDIT * num_host) * block_size)


@dataclass(frozen=True)
class CacheAwareChoice:
    order: list[str]
    reason: str  # "cache" | "load" | "imbalance"
    cached_tokens: int  # what the index predicts the first choice holds


def rank_cache_aware(
    workers: list[WorkerLoad],
    cached_tokens: Mapping[str, int],
    alpha: float,
    imbalance_tokens: int,
    turn: int = 0,
) -> CacheAwareChoice:
    healthy = [w for w in workers if w.routable]
    if not healthy:
        return CacheAwareChoice([], "load", 0)
    least_queued = min(w.queued_prefill_tokens for w in healthy)

    def credit(w: WorkerLoad) -> int:
        balanced = w.queued_prefill_tokens - least_queued <= imbalance_tokens
        return cached_tokens.get(w.address, 0) if balanced else 0

    tie_order = {a: i for i, a in enumerate(rank_prefill(healthy, turn))}
    order = sorted(
        healthy,
        key=lambda w: (-(credit(w) - alpha * w.queued_prefill_tokens), tie_order[w.address]),
    )
    best = order[0]
    best_cached = max(healthy, key=lambda w: cached_tokens.get(w.address, 0))
    if credit(best) > 0:
        reason = "cache"
    elif cached_tokens.get(best_cached.address, 0) > 0 and credit(best_cached) == 0:
        reason = "imbalance"
    else:
        reason = "load"
    return CacheAwareChoice([w.address for w in order], reason, credit(best))
