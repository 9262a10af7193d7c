"""Least-loaded worker choice, with exact orders."""

from __future__ import annotations

from router.policy import WorkerLoad, rank_cache_aware, rank_decode, rank_prefill


def _w(address: str, inflight: int, free: int, total: int = 100, **kw: object) -> WorkerLoad:
    return WorkerLoad(address, inflight, free, total, block_size=16, **kw)  # type: ignore[arg-type]


def test_prefill_fewest_inflight_then_most_free() -> None:
    workers = [_w("a", 2, 90), _w("b", 1, 10), _w("c", 1, 50), _w("d", 0, 0, routable=False)]
    assert rank_prefill(workers) == ["c", "b", "a"]


def test_round_robin_among_equals() -> None:
    workers = [_w("a", 0, 10), _w("b", 0, 10), _w("c", 0, 10)]
    assert rank_prefill(workers, turn=0) == ["a", "b", "c"]
    assert rank_prefill(workers, turn=1) == ["b", "c", "a"]
    assert rank_prefill(workers, turn=2) == ["c", "a", "b"]


def test_decode_prefers_workers_with_room_and_drops_too_small() -> None:
    workers = [
        _w("full", 0, 1),  # 1 free block: must wait for room
        _w("busy", 3, 20),
        _w("tiny", 0, 4, total=4),  # can never hold 5 blocks
        _w("idle", 1, 30),
    ]
    # 70 tokens = 5 blocks of 16.
    assert rank_decode(workers, num_prompt_tokens=70) == ["idle", "busy", "full"]


def test_no_healthy_worker() -> None:
    assert rank_decode([_w("a", 0, 10, routable=False)], num_prompt_tokens=1) == []


def _q(address: str, queued: int, inflight: int = 0) -> WorkerLoad:
    return WorkerLoad(address, inflight, 10, 100, queued_prefill_tokens=queued)


def test_round_robin_rotates_over_healthy_workers() -> None:
    from router.policy import rank_round_robin

    workers = [_w("a", 5, 0), _w("b", 0, 0, routable=False), _w("c", 0, 90)]
    assert rank_round_robin(workers, turn=0) == ["a", "c"]
    assert rank_round_robin(workers, turn=1) == ["c", "a"]


def test_cache_aware_prefers_the_cache_under_ordinary_load() -> None:
    from router.policy import rank_cache_aware

    workers = [_q("a", queued=300), _q("b", queued=0)]
    choice = rank_cache_aware(workers, {"a": 1024, "b": 0}, alpha=1.0, imbalance_tokens=4096)
    # a: 1024 - 300 = 724 beats b: 0.
    assert (choice.order, choice.reason, choice.cached_tokens) == (["a", "b"], "cache", 1024)


def test_cache_aware_weighs_queued_work_against_cached_tokens() -> None:
    from router.policy import rank_cache_aware

    workers = [_q("a", queued=2000), _q("b", queued=0)]
    choice = rank_cache_aware(workers, {"a": 1024}, alpha=1.0, imbalance_tokens=4096)
    # a: 1024 - 2000 < b: 0 -> b, on load.
    assert (choice.order, choice.reason) == (["b", "a"], "load")


def test_imbalance_guard_drops_cache_credit_only_past_the_threshold() -> None:
    from router.policy import rank_cache_aware

    workers = [_q("a", queued=5000), _q("b", queued=0)]
    cached = {"a": 8000}
    kept = rank_cache_aware(workers, cached, alpha=0.1, imbalance_tokens=6000)
    assert (kept.order[0], kept.reason) == ("a", "cache")  # 8000 - 500 > 0
    guarded = rank_cache_aware(workers, cached, alpha=0.1, imbalance_tokens=4096)
    assert (guarded.order, guarded.reason, guarded.cached_tokens) == (["b", "a"], "imbalance", 0)


def test_cache_aware_ties_fall_back_to_least_loaded() -> None:
    from router.policy import rank_cache_aware

    workers = [_q("a", 0, inflight=3), _q("b", 0, inflight=1), _q("c", 0, inflight=0)]
    choice = rank_cache_aware(workers, {}, alpha=1.0, imbalance_tokens=4096)
    assert (choice.order, choice.reason) == (["c", "b", "a"], "load")


def test_decode_round_robin_keeps_capacity_rules() -> None:
    from router.policy import RoutingPolicy

    workers = [_w("a", 5, 30), _w("b", 0, 30), _w("c", 0, 1), _w("tiny", 0, 4, total=4)]
    rr = RoutingPolicy.ROUND_ROBIN
    # Rotation ignores load, but workers with room still come first and "tiny" never fits.
    assert rank_decode(workers, 70, turn=0, policy=rr) == ["a", "b", "c"]
    assert rank_decode(workers, 70, turn=1, policy=rr) == ["b", "a", "c"]


def test_a_host_tier_hit_is_credited_between_a_miss_and_a_device_hit() -> None:
    from router.policy import HOST_HIT_CREDIT, host_credited_tokens

    assert HOST_HIT_CREDIT == 0.5
    assert host_credited_tokens(4, 4, 16) == 64  # all on the device
    assert host_credited_tokens(0, 4, 16) == 32  # all in the host tier: half
    assert host_credited_tokens(2, 6, 16) == 64  # 2 device + 4 host blocks
    assert host_credited_tokens(3, 1, 16) == 48  # never below the device hits
    workers = [WorkerLoad("host-hit", 0, 10, 100), WorkerLoad("miss", 0, 90, 100)]
    credit = {"host-hit": host_credited_tokens(0, 4, 16), "miss": 0}
    assert rank_cache_aware(workers, credit, 0.0, 10_000).order == ["host-hit", "miss"]


def test_can_hold_counts_whole_blocks_and_a_worker_without_stats_holds_nothing() -> None:
    worker = WorkerLoad("a", 0, 0, 4, block_size=16)  # 64 tokens in all
    assert [worker.can_hold(n) for n in (1, 64, 65)] == [True, True, False]
    assert not WorkerLoad("new", 0, 0, 0).can_hold(1)
