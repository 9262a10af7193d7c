"""The cost policy's pricing (router/prefix_pricing.py): exact values for every branch: go to
the holder, wait for a holder whose queue is short, pull to an idle worker, recompute, host
tiers, a holder whose pages cannot be lent."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from engine.kv_layout import KVCacheLayout
from router.policy import WorkerLoad
from router.prefix_pricing import Holding, Option, Priced, Rates, price, usable_blocks
from router.pull_rate import PullRate
from router.ttft_fit import MIN_SAMPLES

LAYOUT = KVCacheLayout("fp", "float32", 16, 2, 2, 64)
# 1000 prompt tokens per s computed, 10000 per s pulled plus 10 ms, 20000 per s from host.
RATES = Rates(1000.0, 10000.0, 0.01, 20000.0)


def worker(address: str, queued: int = 0, **kw: Any) -> WorkerLoad:
    kw.setdefault("kv_layout", LAYOUT)
    return WorkerLoad(address, 0, 100, 100, 16, queued_prefill_tokens=queued, **kw)


def test_usable_blocks_leave_the_last_token_to_compute() -> None:
    assert [usable_blocks(n, 16) for n in (0, 1, 16, 17, 33)] == [0, 0, 0, 1, 2]


def test_an_idle_worker_pulls_what_a_busy_holder_caches() -> None:
    # 401 tokens: 25 usable blocks. B caches 20 (320 tokens) but has 2000 tokens queued.
    holdings = {"b": Holding(20, 20)}
    got = price([worker("a"), worker("b", queued=2000)], holdings, 401, RATES)
    # a: pull 20 blocks = 0.01 + 320 / 10000 = 0.042, compute 81 tokens = 0.081.
    assert got[0] == Priced("a", Option.PULL, pytest.approx(0.123), 0.0, 0, "b", 20)
    # b: wait 2.0, compute 81 tokens.
    assert got[1] == Priced("b", Option.HOLDER, pytest.approx(2.081), 2.0, 320)


def test_a_holder_whose_queue_is_short_is_waited_for() -> None:
    holdings = {"b": Holding(20, 20)}
    got = price([worker("a"), worker("b", queued=30)], holdings, 401, RATES)
    # b: 0.030 wait + 0.081 < a's pull 0.123.
    assert [(p.address, p.option) for p in got] == [("b", Option.HOLDER), ("a", Option.PULL)]
    assert got[0].cost_s == pytest.approx(0.111)


def test_nothing_cached_is_recomputed_least_queued_first() -> None:
    got = price([worker("a", queued=100), worker("b")], {}, 401, RATES)
    assert [(p.address, p.option, p.cost_s) for p in got] == [
        ("b", Option.RECOMPUTE, pytest.approx(0.401)),
        ("a", Option.RECOMPUTE, pytest.approx(0.501)),
    ]


def test_a_short_run_is_not_worth_a_pull() -> None:
    # One block (16 tokens): pulling costs 0.01 + 0.0016 = 0.0116 against 0.016 computed: it
    # pays. With a 20 ms fixed cost it does not.
    holdings = {"b": Holding(1, 1)}
    slow = dataclasses.replace(RATES, pull_overhead_s=0.02)
    got = price([worker("a"), worker("b", queued=5000)], holdings, 401, slow)
    assert (got[0].address, got[0].option) == ("a", Option.RECOMPUTE)
    got = price([worker("a"), worker("b", queued=5000)], holdings, 401, RATES)
    assert (got[0].address, got[0].option, got[0].pull_blocks) == ("a", Option.PULL, 1)


def test_a_puller_pulls_only_past_its_own_device_run_and_prices_its_host_tier() -> None:
    # a holds 5 blocks on device and 10 with its host tier; b holds 20 on device.
    holdings = {"a": Holding(5, 10), "b": Holding(20, 20)}
    got = price([worker("a"), worker("b", queued=5000)], holdings, 401, RATES)
    own = 5 * 16 / 20000 + (401 - 160) / 1000  # host copy of 5 blocks, 241 computed
    pull = 0.01 + 15 * 16 / 10000 + (401 - 320) / 1000  # blocks 5..19 pulled
    assert pull < own
    assert got[0] == Priced("a", Option.PULL, pytest.approx(pull), 0.0, 80, "b", 20)


def test_a_holder_lends_its_host_tier_too_at_the_price_of_its_copy() -> None:
    # b holds 10 blocks on device and 20 with its host tier: the run is 20, 10 copied in.
    holdings = {"b": Holding(10, 20)}
    got = price([worker("a"), worker("b", queued=5000)], holdings, 401, RATES)
    pull = 0.01 + 20 * 16 / 10000 + 10 * 16 / 20000 + (401 - 320) / 1000
    assert got[0] == Priced("a", Option.PULL, pytest.approx(pull), 0.0, 0, "b", 20)
    # A measured pull price has the holder's copy in it already.
    measured = dataclasses.replace(RATES, pull_measured=True)
    got = price([worker("a"), worker("b", queued=5000)], holdings, 401, measured)
    assert got[0].cost_s == pytest.approx(pull - 10 * 16 / 20000)


def test_a_replica_in_a_full_cache_costs_the_prefix_it_evicts() -> None:
    # a's 100 blocks all hold cache entries (free, but cached): the 26 it writes evict 26.
    full = worker("a", num_cached_blocks=100)
    holdings = {"b": Holding(20, 20)}
    b = worker("b", queued=300)  # 0.3 s of queue
    got = price([full, b], holdings, 401, RATES)
    assert (got[0].address, got[0].option) == ("a", Option.PULL)  # evictions free: 0.123 s
    reuse = dataclasses.replace(RATES, eviction_reuse=1.0)
    got = price([full, b], holdings, 401, reuse)
    # a: 0.123 + 26 x 16 / 1000 = 0.539; b writes 6 blocks into spare ones: 0.3 + 0.081.
    assert [(p.address, p.option) for p in got] == [("b", Option.HOLDER), ("a", Option.PULL)]
    assert [p.cost_s for p in got] == [pytest.approx(0.381), pytest.approx(0.539)]
    with pytest.raises(ValueError, match="eviction_reuse"):
        Rates(1.0, 1.0, 0.0, 1.0, eviction_reuse=2.0)


def test_only_native_pages_of_the_same_layout_are_lent() -> None:
    holdings = {"b": Holding(20, 20)}
    other = dataclasses.replace(LAYOUT, page_layout="vllm")
    for b in (
        worker("b", queued=5000, kv_layout=None),
        worker("b", queued=5000, kv_layout=other),
    ):
        got = price([worker("a"), b], holdings, 401, RATES)
        assert (got[0].address, got[0].option) == ("a", Option.RECOMPUTE)


def test_a_holder_too_small_for_the_prompt_still_lends_its_prefix() -> None:
    holdings = {"b": Holding(20, 20)}
    got = price([worker("a")], holdings, 401, RATES, holders=[worker("a"), worker("b")])
    assert got == [Priced("a", Option.PULL, pytest.approx(0.123), 0.0, 0, "b", 20)]
    assert price([worker("a")], holdings, 401, RATES)[0].option is Option.RECOMPUTE


def test_rates_are_checked_and_unroutable_workers_are_not_priced() -> None:
    with pytest.raises(ValueError, match="pull_tokens_per_s must be finite and > 0"):
        Rates(1.0, 0.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="pull_overhead_s"):
        Rates(1.0, 1.0, -1.0, 1.0)
    got = price([worker("a", routable=False), worker("b")], {"a": Holding(20, 20)}, 401, RATES)
    assert [(p.address, p.option) for p in got] == [("b", Option.RECOMPUTE)]


def test_the_pull_rate_is_the_priors_until_measured_then_the_fitted_line() -> None:
    rate = PullRate(prior_tokens_per_s=65536.0, prior_overhead_s=0.01)
    rate.observe(0, 1.0)  # no pull: nothing learnt
    for _ in range(MIN_SAMPLES - 1):
        rate.observe(1000, 0.02 + 1000 / 50000)
    assert rate.price() == (65536.0, 0.01)  # not enough samples yet
    for tokens in (2000, 4000, 8000, 500):  # seconds = 20 ms + tokens / 50000
        rate.observe(tokens, 0.02 + tokens / 50000)
    tokens_per_s, overhead_s = rate.price()
    assert tokens_per_s == pytest.approx(50000.0) and overhead_s == pytest.approx(0.02)
    # Pulls whose time does not grow with their size (waiting on steps): all of it fixed.
    flat = PullRate(65536.0, 0.01)
    for tokens in (512, 256, 512, 128, 512, 256, 384, 512):
        flat.observe(tokens, 0.7)
    tokens_per_s, overhead_s = flat.price()
    assert tokens_per_s == 1e12 and overhead_s == pytest.approx(0.7)
