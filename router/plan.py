"""The routing decision, whole: one pure function from what the router knows about a request and
its workers (``Facts``) to what it will do (``Plan``). No I/O; exact-value tests in
``tests/unit/test_plan.py``.

The I/O shell (``Dispatcher.place``) gathers the facts (load snapshots, cached tokens per worker
from the prefix index, the pools' rotation turns), calls ``plan`` and resolves addresses to
workers; ``router/generation.py`` executes the plan. A fallback re-plans: a worker that turned
the attempt away goes into ``exclude`` (and a conditional local prefill so turned away sets
``local=False``: disaggregate); a worker this request failed on goes into ``avoid``, tried last.
The policies themselves (rankings) are ``router/policy.py``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from router.config import RouterConfig
from router.policy import (
    RoutingPolicy,
    WorkerLoad,
    rank_cache_aware,
    rank_decode,
    rank_prefill,
    rank_round_robin,
    takes_kv_of,
)
from router.prefix_pricing import Holding, Rates, local_pull, price


class Route(Enum):
    """How an attempt runs: the one name of the path a request takes (plans, traces'
    ``pdserve.path``, phase and decision metrics, logs)."""

    DISAGGREGATED = "disaggregated"  # a prefill worker prefills, a decode worker pulls the KV
    # Conditional disaggregation: a decode worker prefills a prompt whose uncached part is
    # short (below --local-prefill-tokens), and decodes it.
    LOCAL = "local"
    COLOCATED = "colocated"  # the colocated mode: a decode worker prefills every prompt


class Unserved(Enum):
    """Why a plan has no worker to start with."""

    NO_WORKER = "no_worker"  # none healthy (or every one turned this attempt away)
    TOO_LARGE = "too_large"  # healthy ones, but none could ever hold the prompt
    NO_PAIR = "no_pair"  # healthy prefill workers, but no decode worker can take their KV


@dataclass(frozen=True)
class Facts:
    num_prompt_tokens: int
    prefill: tuple[WorkerLoad, ...]  # the prefill pool's snapshot (empty when colocated)
    decode: tuple[WorkerLoad, ...]
    # Cache credit per prefill worker (tokens) from the prefix index; None: not looked up (no
    # index, or not cache-aware).
    prefill_cached: Mapping[str, int] | None = None
    decode_cached: Mapping[str, int] = field(default_factory=dict)  # for a local prefill
    prefill_turn: int = 0  # each pool's rotation, advanced once per plan by the shell
    decode_turn: int = 0
    avoid: frozenset[str] = frozenset()  # this request failed there: tried last
    exclude: frozenset[str] = frozenset()  # turned this attempt away: not a candidate
    local: bool = True  # False: a local prefill turned the attempt away, disaggregate
    # The cost policy's inputs: what each prefill worker caches of the prompt (None: not looked
    # up) and the rates it prices with.
    prefill_holdings: Mapping[str, Holding] | None = None
    rates: Rates | None = None
    # KV stores (docs/kv-cache.md): holders a prefill worker may pull from, never routed to;
    # their holdings are in ``prefill_holdings`` (a store's blocks read as its device run).
    stores: tuple[WorkerLoad, ...] = ()


# The reason of a pull from a KV store (``Option.PULL`` is a peer's).
STORE_PULL = "store"
# A decode worker prefills the prompt after pulling its prefix from a holder.
LOCAL_PULL = "local_prefill_pull"


@dataclass(frozen=True)
class Pull:
    """The first prefill choice pulls the prompt's prefix from ``holder`` (its device run of
    ``num_blocks`` leading blocks) before computing the rest (docs/kv-cache.md)."""

    holder: str
    num_blocks: int


@dataclass(frozen=True)
class Plan:
    route: Route
    prefill: tuple[str, ...]  # prefill candidates, best first (empty unless DISAGGREGATED)
    decode: tuple[str, ...]  # decode candidates, best first (else: the first one prefills)
    cached_tokens: int  # what the index predicts the first prefill (or local) choice holds
    reason: str  # pdserve_routing_decisions_total's reason label
    unserved: Unserved | None = None  # set when there is no first candidate
    # The cost policy chose a pull for the first prefill choice (or, LOCAL, the decode worker).
    pull: Pull | None = None


def _last(order: list[str], avoid: frozenset[str]) -> tuple[str, ...]:
    return tuple(sorted(order, key=lambda address: address in avoid))  # stable


def plan(facts: Facts, config: RouterConfig) -> Plan:
    n = facts.num_prompt_tokens
    candidates = [w for w in facts.decode if w.address not in facts.exclude]
    decode = _last(rank_decode(candidates, n, facts.decode_turn, config.decode_policy), facts.avoid)
    if config.colocated:  # every prompt, whatever is cached: the load-ranked decode worker
        unserved = None
        if not decode:
            alive = any(w.routable for w in candidates)
            unserved = Unserved.TOO_LARGE if alive and not facts.exclude else Unserved.NO_WORKER
        return Plan(Route.COLOCATED, (), decode, 0, "colocated", unserved)
    threshold = config.local_prefill_tokens
    if facts.local and threshold > 0 and decode:
        cached = facts.decode_cached
        best = max(decode, key=lambda a: cached.get(a, 0))  # ties: the ranked order
        rest = tuple(a for a in decode if a != best)
        if n - cached.get(best, 0) < threshold:
            return Plan(Route.LOCAL, (), (best, *rest), cached.get(best, 0), "local_prefill")
        pull = _local_pull(facts, best, cached.get(best, 0), threshold)
        if pull is not None:  # short enough once it pulled its prefix from a holder
            size = next(w.block_size for w in candidates if w.address == best)
            predicted = pull.num_blocks * size
            return Plan(Route.LOCAL, (), (best, *rest), predicted, LOCAL_PULL, None, pull)
    # Only workers whose cache could hold the prompt (one whose stats have not come yet may):
    # a small one would answer RESOURCE_EXHAUSTED while a larger one can serve it.
    # And only those whose KV some decode candidate can take (tensor parallelism).
    by_address = {w.address: w for w in candidates}
    fit = [
        w
        for w in facts.prefill
        if w.routable and w.address not in facts.exclude and (not w.stats_known or w.can_hold(n))
    ]
    able = [w for w in fit if any(takes_kv_of(by_address[a], w) for a in decode)]
    order, reason, predicted, pull = _rank_prefill(able, facts, config)
    prefill = _last(order, facts.avoid)
    if prefill[:1] != tuple(order[:1]):
        predicted, pull = 0, None  # the prediction was for a worker now tried last
    unserved = None
    if not prefill:  # NO_PAIR: some were left out only for their KV's tensor parallelism
        unserved = Unserved.NO_PAIR if fit and decode else Unserved.NO_WORKER
    if prefill:  # the decode workers that can take the first choice's KV
        first = next(w for w in able if w.address == prefill[0])
        decode = tuple(a for a in decode if takes_kv_of(by_address[a], first))
    return Plan(Route.DISAGGREGATED, prefill, decode, predicted, reason, unserved, pull)


def _local_pull(facts: Facts, address: str, own_tokens: int, threshold: int) -> Pull | None:
    """The cost policy's pull for a local prefill on decode worker ``address``, if any."""
    if facts.prefill_holdings is None or not facts.rates:
        return None
    worker = next(w for w in facts.decode if w.address == address)
    lenders = [w for w in (*facts.prefill, *facts.stores) if w.stats_known]
    n, holdings = facts.num_prompt_tokens, facts.prefill_holdings
    found = local_pull(worker, own_tokens, lenders, holdings, n, facts.rates, threshold)
    return None if found is None else Pull(*found)


def _rank_prefill(
    able: list[WorkerLoad], facts: Facts, config: RouterConfig
) -> tuple[list[str], str, int, Pull | None]:
    """Prefill workers best first, the reason, the cached tokens predicted for the first (a
    pull's included), and the first's pull."""
    policy = config.prefill_policy
    if policy is RoutingPolicy.COST and facts.prefill_holdings is not None and facts.rates:
        n, holdings = facts.num_prompt_tokens, facts.prefill_holdings
        lenders = [w for w in facts.prefill if w.stats_known]  # a cache too small may lend
        lenders += [w for w in facts.stores if w.stats_known]
        priced = price(able, holdings, n, facts.rates, facts.prefill_turn, lenders)
        if not priced:
            return [], "load", 0, None
        first = priced[0]
        pull, reason = None, first.option.value
        predicted = first.cached_tokens
        if first.pull_from is not None:
            pull = Pull(first.pull_from, first.pull_blocks)
            size = next(w.block_size for w in able if w.address == first.address)
            predicted = first.pull_blocks * size
            if any(s.address == first.pull_from for s in facts.stores):
                reason = STORE_PULL
        return [p.address for p in priced], reason, predicted, pull
    if policy is RoutingPolicy.CACHE_AWARE and facts.prefill_cached:
        choice = rank_cache_aware(
            able,
            facts.prefill_cached,
            config.cache_alpha,
            config.imbalance_tokens,
            facts.prefill_turn,
        )
        return choice.order, choice.reason, choice.cached_tokens, None
    cache_policies = (RoutingPolicy.CACHE_AWARE, RoutingPolicy.COST)
    reason = "no_index" if policy in cache_policies else "load"
    if policy is RoutingPolicy.ROUND_ROBIN:
        return rank_round_robin(able, facts.prefill_turn), reason, 0, None
    return rank_prefill(able, facts.prefill_turn), reason, 0, None
