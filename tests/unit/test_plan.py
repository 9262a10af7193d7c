"""The routing plan (router/plan.py): the whole decision, exact values for every branch."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.kv_layout import KVCacheLayout
from router.config import RouterConfig
from router.plan import Facts, Plan, Pull, Route, Unserved, plan
from router.policy import RoutingPolicy, WorkerLoad, host_credited_tokens
from router.prefix_pricing import Holding, Rates

CONFIG = RouterConfig(
    model="m", prefill_addresses=("p",), decode_addresses=("d",), local_prefill_tokens=32
)
COLOCATED = RouterConfig(model="m", decode_addresses=("d",), colocated=True)


def load(
    address: str, inflight: int = 0, free: int = 100, num_blocks: int = 100, **kw: Any
) -> WorkerLoad:
    return WorkerLoad(address, inflight, free, num_blocks, 16, **kw)


P = (load("p1"), load("p2", inflight=1), load("p3", inflight=2))
D = (load("d1", inflight=1), load("d2"), load("d3", inflight=2))


def facts(
    n: int = 200,
    prefill: tuple[WorkerLoad, ...] = P,
    decode: tuple[WorkerLoad, ...] = D,
    **kw: Any,
) -> Facts:
    return Facts(n, prefill, decode, **kw)


def test_a_long_uncached_prompt_is_disaggregated_least_loaded_first() -> None:
    got = plan(
        facts(prefill_cached={}),
        dataclasses.replace(CONFIG, prefill_policy=RoutingPolicy.LEAST_LOADED),
    )
    assert got == Plan(Route.DISAGGREGATED, ("p1", "p2", "p3"), ("d2", "d1", "d3"), 0, "load")


def test_conditional_disaggregation_threshold() -> None:
    # 40 tokens, 16 cached on d3: 24 uncached < 32 -> d3 prefills them itself.
    got = plan(facts(40, decode_cached={"d3": 16}), CONFIG)
    assert got == Plan(Route.LOCAL, (), ("d3", "d2", "d1"), 16, "local_prefill")
    # 31 uncached anywhere: the least-loaded decode worker (ties: the ranked order).
    assert plan(facts(31), CONFIG).decode == ("d2", "d1", "d3")
    assert plan(facts(31), CONFIG).route is Route.LOCAL
    # Exactly the threshold uncached: disaggregated.
    assert plan(facts(48, decode_cached={"d1": 16}), CONFIG).route is Route.DISAGGREGATED
    # 0 turns conditional disaggregation off.
    off = dataclasses.replace(CONFIG, local_prefill_tokens=0)
    assert plan(facts(1), off).route is Route.DISAGGREGATED
    # A local worker turned the attempt away: disaggregate, without it.
    again = plan(facts(31, exclude=frozenset({"d2"}), local=False), CONFIG)
    assert again.route is Route.DISAGGREGATED and again.decode == ("d1", "d3")


def test_colocated_plans_every_prompt_on_the_load_ranked_decode_worker() -> None:
    assert plan(facts(5000), COLOCATED) == Plan(
        Route.COLOCATED, (), (), 0, "colocated", Unserved.TOO_LARGE
    )
    got = plan(facts(200, prefill=()), COLOCATED)
    assert got == Plan(Route.COLOCATED, (), ("d2", "d1", "d3"), 0, "colocated")
    turned_away = frozenset({"d1", "d2", "d3"})
    none = plan(facts(200, prefill=(), exclude=turned_away), COLOCATED)
    assert none.decode == () and none.unserved is Unserved.NO_WORKER
    sick = tuple(dataclasses.replace(d, routable=False) for d in D)
    assert plan(facts(200, decode=sick), COLOCATED).unserved is Unserved.NO_WORKER


def test_avoided_workers_come_last_and_lose_the_prediction() -> None:
    cfg = dataclasses.replace(CONFIG, local_prefill_tokens=0)
    got = plan(facts(200, prefill_cached={"p1": 64}, avoid=frozenset({"p1", "d2"})), cfg)
    assert got.prefill == ("p2", "p3", "p1") and got.decode == ("d1", "d3", "d2")
    assert got.cached_tokens == 0 and got.reason == "cache"


def test_only_prefill_workers_whose_cache_can_hold_the_prompt() -> None:
    small = load("small", num_blocks=4)  # 64 tokens
    unknown = load("new", stats_known=False, num_blocks=0)  # no stats yet: it may hold it
    cfg = dataclasses.replace(
        CONFIG, local_prefill_tokens=0, prefill_policy=RoutingPolicy.LEAST_LOADED
    )
    got = plan(facts(100, prefill=(small, unknown, load("big", inflight=3))), cfg)
    assert got.prefill == ("new", "big")
    assert plan(facts(100, prefill=(small,)), cfg).unserved is Unserved.NO_WORKER


def test_cache_aware_prefill() -> None:
    cfg = dataclasses.replace(CONFIG, local_prefill_tokens=0)
    # The cache decides under ordinary load.
    got = plan(facts(200, prefill_cached={"p3": 128}), cfg)
    assert got.prefill[0] == "p3" and got.reason == "cache" and got.cached_tokens == 128
    # A worker far past the least-queued one loses its credit.
    queued = (load("p1"), load("p2"), load("p3", queued_prefill_tokens=9000))
    got = plan(facts(200, prefill=queued, prefill_cached={"p3": 128}), cfg)
    assert got.prefill[0] == "p1" and got.reason == "imbalance" and got.cached_tokens == 0
    # An index that answered with no hits: load.
    assert plan(facts(200, prefill_cached={"p1": 0, "p2": 0, "p3": 0}), cfg).reason == "load"
    # No index lookup (none configured, or Redis down): load order, reason no_index.
    got = plan(facts(200), cfg)
    assert got.prefill == ("p1", "p2", "p3") and got.reason == "no_index"
    # Host-tier blocks earn half a device block's credit.
    credit = host_credited_tokens(2, 6, 16)
    assert credit == 64
    got = plan(facts(200, prefill_cached={"p2": credit, "p3": 48}), cfg)
    assert got.prefill[0] == "p2" and got.cached_tokens == 64


def test_round_robin_takes_turns() -> None:
    round_robin = RoutingPolicy.ROUND_ROBIN
    cfg = dataclasses.replace(
        CONFIG, local_prefill_tokens=0, prefill_policy=round_robin, decode_policy=round_robin
    )
    firsts = [plan(facts(200, prefill_turn=t, decode_turn=t), cfg) for t in range(1, 5)]
    assert [p.prefill[0] for p in firsts] == ["p2", "p3", "p1", "p2"]
    assert [p.decode[0] for p in firsts] == ["d2", "d3", "d1", "d2"]
    assert {p.reason for p in firsts} == {"load"}


def test_decode_workers_with_free_blocks_now_come_first() -> None:
    full = (load("d1", free=2), load("d2", inflight=3), load("tiny", num_blocks=3))
    cfg = dataclasses.replace(CONFIG, local_prefill_tokens=0)
    assert plan(facts(200, decode=full), cfg).decode == ("d2", "d1")  # tiny: never


PAGE = "vllm/CPU_ATTN/BHx32x128"  # block-major pages, heads outermost: cut by heads


def test_a_prefill_worker_pairs_only_with_decode_workers_that_can_take_its_shards() -> None:
    """The pair is chosen by ``engine.kv_shards``' rule, never refused per request. A model
    of 2 KV heads: TP=1 and TP=2 map both ways; TP=3 divides neither; TP=4 replicates heads
    (a copy per rank), so it maps only to TP=4. Until a worker's stats came, it counts as one
    rank."""
    config = dataclasses.replace(CONFIG, prefill_policy=RoutingPolicy.LEAST_LOADED)

    def tp(address: str, tp_size: int, inflight: int = 0, page: str = PAGE) -> WorkerLoad:
        heads = max(1, 2 // tp_size)
        layout = KVCacheLayout(
            "fp", "bfloat16", 32, 2, heads, 64, page_layout=page, tp_size=tp_size
        )
        return load(address, inflight, kv_layout=layout)

    prefill = (tp("p2", 2), tp("p1", 1, inflight=1), tp("p3", 3), tp("p4", 4))
    decode = (tp("d1", 1, inflight=1), tp("d2", 2), tp("d3", 3, inflight=2))
    got = plan(facts(prefill=prefill, decode=decode, prefill_cached={}), config)
    # p4 has no decode worker to take its KV; p2 (TP=2) goes to d1 (TP=1) or d2 (TP=2).
    assert got == Plan(Route.DISAGGREGATED, ("p2", "p3", "p1"), ("d2", "d1"), 0, "load")
    third = plan(facts(prefill=prefill, decode=decode, exclude=frozenset({"p2", "p1"})), config)
    assert (third.prefill, third.decode) == (("p3",), ("d3",))
    alone = plan(facts(prefill=(tp("p4", 4),), decode=decode), config)
    assert (alone.prefill, alone.unserved) == ((), Unserved.NO_PAIR)
    none = plan(facts(prefill=(tp("p4", 4, inflight=0),), decode=(), prefill_cached={}), config)
    assert none.unserved is Unserved.NO_WORKER
    unknown = (load("d1"), load("d2", inflight=1))  # no stats yet: one rank each
    early = plan(facts(prefill=(tp("p1", 1),), decode=unknown), config)
    assert early.decode == ("d1", "d2")
    assert plan(facts(prefill=(tp("p2", 2),), decode=unknown), config).unserved is Unserved.NO_PAIR
    # Pages not cut by heads (vLLM's LBNHC, whose name carries the head count and order):
    # unequal sizes never pair; equal ones do.
    cuda = (tp("d1", 1, page="vllm/FA/B16x4x128/NHC"), tp("d2", 2, page="vllm/FA/B16x2x128/NHC"))
    got = plan(facts(prefill=(tp("p2", 2, page="vllm/FA/B16x2x128/NHC"),), decode=cuda), config)
    assert got.decode == ("d2",)


def test_the_cost_policy_plans_a_pull_to_the_cheapest_worker() -> None:
    cost = dataclasses.replace(CONFIG, prefill_policy=RoutingPolicy.COST)
    layout = KVCacheLayout("fp", "float32", 16, 2, 2, 64)
    idle, busy = (
        load("a", kv_layout=layout),
        load("b", kv_layout=layout, queued_prefill_tokens=4000),
    )
    rates = Rates(1000.0, 10000.0, 0.01, 20000.0)
    holdings = {"b": Holding(20, 20)}
    got = plan(facts(401, (idle, busy), prefill_holdings=holdings, rates=rates), cost)
    # a pulls b's 20 blocks (320 tokens: the prediction) and computes the rest.
    assert got == Plan(
        Route.DISAGGREGATED, ("a", "b"), ("d2", "d1", "d3"), 320, "pull", None, Pull("b", 20)
    )
    # b's queue short: go to the holder, no pull.
    short = dataclasses.replace(busy, queued_prefill_tokens=10)
    got = plan(facts(401, (idle, short), prefill_holdings=holdings, rates=rates), cost)
    assert (got.prefill, got.reason, got.cached_tokens, got.pull) == (
        ("b", "a"),
        "holder",
        320,
        None,
    )
    # The request failed on a: it goes last, and its pull with it.
    got = plan(
        facts(401, (idle, busy), prefill_holdings=holdings, rates=rates, avoid=frozenset({"a"})),
        cost,
    )
    assert (got.prefill, got.cached_tokens, got.pull) == (("b", "a"), 0, None)
    # No index: the load order.
    got = plan(facts(401, (idle, busy)), cost)
    assert (got.prefill, got.reason, got.pull) == (("a", "b"), "no_index", None)


def test_the_cost_policy_plans_a_pull_from_a_kv_store() -> None:
    """A store is a holder, never a candidate: its run is pulled by the cheapest worker, with
    the reason "store"; a worker's own longer run, or a store of another layout, wins over it."""
    cost = dataclasses.replace(CONFIG, prefill_policy=RoutingPolicy.COST)
    layout = KVCacheLayout("fp", "float32", 16, 2, 2, 64)
    a, b = load("a", kv_layout=layout), load("b", kv_layout=layout, inflight=1)
    store = load("s", kv_layout=layout, num_blocks=1000)
    rates = Rates(1000.0, 10000.0, 0.01, 20000.0)
    holdings = {"s": Holding(20, 20)}
    got = plan(facts(401, (a, b), prefill_holdings=holdings, rates=rates, stores=(store,)), cost)
    # Either pulls the store's 20 blocks: 0.01 + 320 / 10000 + 81 / 1000 = 0.123 s (a: less
    # loaded); a recompute would cost 0.401 s.
    assert got == Plan(
        Route.DISAGGREGATED, ("a", "b"), ("d2", "d1", "d3"), 320, "store", None, Pull("s", 20)
    )
    # b caches the first 4 blocks: it pulls only the other 16 (0.1166 s) and goes first.
    holdings = {"s": Holding(20, 20), "b": Holding(4, 4)}
    got = plan(facts(401, (a, b), prefill_holdings=holdings, rates=rates, stores=(store,)), cost)
    assert (got.prefill, got.reason, got.pull) == (("b", "a"), "store", Pull("s", 20))
    # A store of another layout lends nothing: b computes what it lacks, a all of it.
    other = load("s", kv_layout=KVCacheLayout("other", "float32", 16, 2, 2, 64))
    got = plan(facts(401, (a, b), prefill_holdings=holdings, rates=rates, stores=(other,)), cost)
    assert (got.prefill, got.reason, got.pull) == (("b", "a"), "holder", None)


def test_a_local_prefill_pulls_a_prefix_that_makes_the_rest_short() -> None:
    """The cost policy lets a decode worker prefill locally once it pulled a holder's run of
    the prompt (a prefill worker's or a store's) when what is left is under the local bound
    and the pull costs less than computing those blocks; reason "local_prefill_pull"."""
    cost = dataclasses.replace(CONFIG, prefill_policy=RoutingPolicy.COST, local_prefill_tokens=64)
    layout = KVCacheLayout("fp", "float32", 16, 2, 2, 64)
    prefill = (load("p", kv_layout=layout),)
    decode = (load("d1", kv_layout=layout), load("d2", kv_layout=layout, inflight=1))
    store = load("s", kv_layout=layout)
    rates = Rates(1000.0, 10000.0, 0.01, 20000.0)
    # 401 tokens: the store holds 20 blocks (320), d2 caches 8 (128): the rest is 81 >= 64.
    holdings = {"s": Holding(20, 20)}
    base = facts(401, prefill, decode, prefill_holdings=holdings, rates=rates, stores=(store,))
    got = plan(dataclasses.replace(base, decode_cached={"d2": 128}), cost)
    assert got.route is Route.DISAGGREGATED  # the rest after the pull is not short
    # 370 tokens: after the pull, 50 are left. d2 pulls blocks 8..19: 0.01 + 192 / 10000 s
    # against 192 / 1000 s to compute them.
    short = dataclasses.replace(base, num_prompt_tokens=370, decode_cached={"d2": 128})
    assert plan(short, cost) == Plan(
        Route.LOCAL, (), ("d2", "d1"), 320, "local_prefill_pull", None, Pull("s", 20)
    )
    # A pull dearer than the compute (a slow link): no pull, the prompt disaggregates.
    slow = dataclasses.replace(short, rates=Rates(1000.0, 100.0, 0.01, 20000.0))
    assert plan(slow, cost).route is Route.DISAGGREGATED
    # Without the cost policy (no holdings looked up): no pull.
    assert plan(dataclasses.replace(short, prefill_holdings=None, rates=None), cost).pull is None
