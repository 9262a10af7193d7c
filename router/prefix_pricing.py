"""The ``cost`` prefill policy (docs/kv-cache.md): every option a prompt's cached prefix gives
is priced in seconds to its first prompt token computed, and the cheapest wins. Pure, no I/O;
exact-value tests in ``tests/unit/test_prefix_pricing.py``.

Per candidate prefill worker ``w``, with ``n`` prompt tokens of which the first ``u`` whole
blocks may be cached (every block but the one holding the last token, as the engine counts):
- **at w, from its own cache** (``holder`` when it holds any, else ``recompute``): its queue
  (the uncached prompt tokens this router sent it, not yet done, at the prefill rate), its
  host-tier blocks copied in, and the rest computed;
- **at w, pulling from a peer** (``pull``): the peer that holds the longest run of the prompt's
  blocks (its device cache, then its host tier), when that run is longer than what ``w`` holds
  in any tier: the queue, a pull's fixed cost, the blocks ``w`` lacks from its device run to
  the peer's end at the pull rate, the peer's host-tier part copied in first, the rest
  computed.

A busy holder is priced by its queue, so the cheapest of "go to the holder", "go elsewhere and
pull" and "go elsewhere and recompute" falls out of one comparison ("wait for the holder" is
the first when its queue is short). Either option at a worker writes the blocks past its device
run; those its spare blocks (free, holding no cache entry) cannot take evict cached ones, each
priced at ``eviction_reuse`` x its recompute: going elsewhere makes a replica, and a replica in
a full cache costs another prefix. Workers are ranked by their cheapest option; ties keep the
load order (``rank_prefill``).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass

from engine.kv_layout import NATIVE_PAGE_LAYOUT
from router.policy import WorkerLoad, rank_prefill


class Option(enum.Enum):
    """What a prompt's prefix costs at a worker: its reason label in routing decisions."""

    HOLDER = "holder"  # computed where (part of) its prefix is cached
    PULL = "pull"  # its prefix pulled from a peer first
    RECOMPUTE = "recompute"  # nothing of it cached anywhere that pays


@dataclass(frozen=True)
class Holding:
    """What a worker caches of the prompt, in leading whole blocks (the prefix index's)."""

    device_blocks: int = 0
    any_tier_blocks: int = 0  # device and host together (>= device_blocks)


@dataclass(frozen=True)
class Rates:
    """Per worker: prompt tokens computed per second, tokens a peer pull moves per second and
    its fixed cost, and tokens per second copied in from a host tier."""

    prefill_tokens_per_s: float
    pull_tokens_per_s: float
    pull_overhead_s: float
    host_tokens_per_s: float
    # The pull price is measured (router/pull_rate.py): a holder's host-tier copy, done before
    # it answers, is in it already.
    pull_measured: bool = False
    # The share of the cached blocks a worker evicts to make room that is needed again: each
    # costs its recompute (0: evictions are free).
    eviction_reuse: float = 0.0

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "pull_tokens_per_s", "host_tokens_per_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0, got {value}")
        if not (math.isfinite(self.pull_overhead_s) and self.pull_overhead_s >= 0):
            raise ValueError(f"pull_overhead_s must be finite and >= 0, got {self.pull_overhead_s}")
        if not 0 <= self.eviction_reuse <= 1:
            raise ValueError(f"eviction_reuse must be in [0, 1], got {self.eviction_reuse}")


@dataclass(frozen=True)
class Priced:
    """A worker's cheapest option and its parts (seconds)."""

    address: str
    option: Option
    cost_s: float
    wait_s: float
    cached_tokens: int  # served from its own cache (device, and host copied in)
    pull_from: str | None = None  # the holder, for PULL
    pull_blocks: int = 0  # the holder's run: the PrefixSource's num_blocks


def usable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Leading whole blocks a cache may serve: one token is always computed."""
    return max(0, num_prompt_tokens - 1) // block_size


def price(
    workers: list[WorkerLoad],
    holdings: Mapping[str, Holding],
    num_prompt_tokens: int,
    rates: Rates,
    turn: int = 0,
    holders: list[WorkerLoad] | None = None,
) -> list[Priced]:
    """The routable ``workers``, cheapest first, each with its cheapest option. ``holders``:
    the routable ones a pull may come from (default: ``workers``); a worker whose cache is too
    small for the whole prompt may still lend its prefix."""
    healthy = [w for w in workers if w.routable]
    lenders = [w for w in (workers if holders is None else holders) if w.routable]
    load_order = {a: i for i, a in enumerate(rank_prefill(healthy, turn))}
    priced = [_cheapest(w, lenders, holdings, num_prompt_tokens, rates) for w in healthy]
    return sorted(priced, key=lambda p: (p.cost_s, load_order[p.address]))


def _cheapest(
    w: WorkerLoad,
    workers: list[WorkerLoad],
    holdings: Mapping[str, Holding],
    n: int,
    rates: Rates,
) -> Priced:
    size, usable = w.block_size, usable_blocks(n, w.block_size)
    mine = holdings.get(w.address, Holding())
    device = min(mine.device_blocks, usable)
    any_tier = max(device, min(mine.any_tier_blocks, usable))
    wait = w.queued_prefill_tokens / rates.prefill_tokens_per_s
    # Either option writes every block past its device run: what its free blocks that hold
    # no cache entry cannot take evicts cached ones (a replica of a prefix costs another).
    writes = w.blocks_for(n) - device
    spare = max(0, w.num_free_blocks - w.num_cached_blocks)
    evicted = max(0, writes - spare) * size / rates.prefill_tokens_per_s * rates.eviction_reuse
    host_s = (any_tier - device) * size / rates.host_tokens_per_s
    own_cost = wait + evicted + host_s + (n - any_tier * size) / rates.prefill_tokens_per_s
    own = Option.HOLDER if any_tier else Option.RECOMPUTE
    best = Priced(w.address, own, own_cost, wait, any_tier * size)
    holder = _longest_peer_run(w, workers, holdings, usable)
    if holder is not None:
        address, run, holder_device = holder
        if run > any_tier:
            pull_s = rates.pull_overhead_s + (run - device) * size / rates.pull_tokens_per_s
            if not rates.pull_measured:  # the holder copies its host-tier part in first
                host_part = max(0, run - max(holder_device, device))
                pull_s += host_part * size / rates.host_tokens_per_s
            cost = wait + evicted + pull_s + (n - run * size) / rates.prefill_tokens_per_s
            if cost < best.cost_s:
                best = Priced(w.address, Option.PULL, cost, wait, device * size, address, run)
    return best


def local_pull(
    worker: WorkerLoad,
    own_tokens: int,
    holders: list[WorkerLoad],
    holdings: Mapping[str, Holding],
    num_prompt_tokens: int,
    rates: Rates,
    local_tokens: int,
) -> tuple[str, int] | None:
    """A decode worker that would prefill the prompt itself (a local prefill: what is left
    to compute is under ``local_tokens``) once it pulled a longer run of its prefix than the
    ``own_tokens`` it caches: the holder (a prefill worker or a KV store) and its run in
    blocks, when the pull costs less than computing those blocks there; else None."""
    size = worker.block_size
    usable = usable_blocks(num_prompt_tokens, size)
    found = _longest_peer_run(worker, [h for h in holders if h.routable], holdings, usable)
    own = own_tokens // size
    if found is None or found[1] <= own or num_prompt_tokens - found[1] * size >= local_tokens:
        return None
    address, run, holder_device = found
    pull_s = rates.pull_overhead_s + (run - own) * size / rates.pull_tokens_per_s
    if not rates.pull_measured:  # the holder copies its host-tier part in first
        pull_s += max(0, run - max(holder_device, own)) * size / rates.host_tokens_per_s
    if pull_s >= (run - own) * size / rates.prefill_tokens_per_s:
        return None
    return address, run


def can_lend_to(holder: WorkerLoad, puller: WorkerLoad) -> bool:
    """Whether ``puller`` can take ``holder``'s blocks as they are: both native engines'
    pages (vLLM's cannot be lent: docs/engines.md), of the same layout, both known."""
    a, b = holder.kv_layout, puller.kv_layout
    return a is not None and a == b and a.page_layout == NATIVE_PAGE_LAYOUT


def _longest_peer_run(
    w: WorkerLoad, workers: list[WorkerLoad], holdings: Mapping[str, Holding], usable: int
) -> tuple[str, int, int] | None:
    """The other worker with the longest run of the prompt's blocks (its device, then its
    host tier) that ``w`` can take (ties: the first listed): its address, that run and the
    run's device part; None when no such one holds any."""
    found: tuple[str, int, int] | None = None
    for other in workers:
        if other.address == w.address or not can_lend_to(other, w):
            continue
        held = holdings.get(other.address, Holding())
        run = min(max(held.any_tier_blocks, held.device_blocks), usable)
        if run > 0 and (found is None or run > found[1]):
            found = (other.address, run, min(held.device_blocks, usable))
    return found
