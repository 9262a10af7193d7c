"""Where a worker offloads a prefix (pdserve/worker/store_offload.py ``placement``): rendezvous
hashing on the prompt's first block, so a prefix's blocks meet on the same stores."""

from __future__ import annotations

from pdserve.worker.store_offload import placement

STORES = [f"10.0.0.{i}:50081" for i in range(1, 6)]


def test_a_prefix_goes_to_replicas_distinct_stores_whatever_their_order() -> None:
    for head in (bytes([i]) * 16 for i in range(20)):
        chosen = placement(head, STORES, 2)
        assert len(chosen) == len(set(chosen)) == 2
        assert placement(head, list(reversed(STORES)), 2) == chosen
        assert placement(head, STORES, 1) == chosen[:1]  # the first replica is the one store


def test_a_store_leaving_moves_only_the_prefixes_it_held() -> None:
    heads = [bytes([i]) * 16 for i in range(50)]
    gone = STORES[2]
    rest = [s for s in STORES if s != gone]
    for head in heads:
        before, after = placement(head, STORES, 2), placement(head, rest, 2)
        if gone not in before:
            assert after == before
        else:  # its other replica stays, first now
            assert [s for s in before if s != gone] == after[:1]


def test_spread_and_fewer_stores_than_replicas() -> None:
    firsts = {placement(bytes([i]) * 16, STORES, 1)[0] for i in range(50)}
    assert firsts == set(STORES)  # 50 prefixes reach every one of 5 stores
    assert placement(b"\x01" * 16, STORES[:1], 3) == STORES[:1]
    assert placement(b"\x01" * 16, [], 2) == []
