"""Least-loaded worker choice, with exact orders."""

from __future__ import annotations

from router.policy import WorkerLoad, rank_decode, rank_prefill


def _w(address: str, inflight: int, free: int, total: int = 100, **kw: object) -> WorkerLoad:
    return WorkerLoad(address, inflight, free, total, block_size=16, **kw)  # type: ignore[arg-type]


def test_prefill_fewest_inflight_then_most_free() -> None:
    workers = [_w("a", 2, 90), _w("b", 1, 10), _w("c", 1, 50), _w("d", 0, 0, healthy=False)]
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
    assert rank_decode([_w("a", 0, 10, healthy=False)], num_prompt_tokens=1) == []
