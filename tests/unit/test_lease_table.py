"""LeaseTable: each lease is freed exactly once — by end, expiry, or the last checkin."""

from __future__ import annotations

import pytest

from kvtransfer.lease_table import LeaseTable


def test_end_frees_once() -> None:
    table = LeaseTable(lease_s=30.0)
    table.grant("a", [3, 4], now_s=100.0, token="t")
    assert table.end("a") == (True, True)
    assert table.end("a") == (False, False)
    assert len(table) == 0


def test_expiry_after_deadline_only() -> None:
    table = LeaseTable(lease_s=30.0)
    table.grant("a", [1], now_s=100.0, token="t")
    table.grant("b", [2], now_s=110.0, token="t")
    assert table.next_deadline_s() == 130.0
    assert table.expire(now_s=129.9) == []
    assert table.expire(now_s=130.0) == ["a"]
    assert table.next_deadline_s() == 140.0
    assert table.end("a") == (False, False)  # already freed by expiry


def test_renew_extends_deadline() -> None:
    table = LeaseTable(lease_s=10.0)
    table.grant("a", [1], now_s=0.0, token="t")
    assert table.renew("a", now_s=8.0, token="t")
    assert table.expire(now_s=12.0) == []
    assert table.next_deadline_s() == 18.0
    assert not table.renew("missing", now_s=8.0, token="t")


def test_checkout_defers_end_and_expiry() -> None:
    table = LeaseTable(lease_s=10.0)
    table.grant("a", [5, 6, 7], now_s=0.0, token="t")
    assert table.checkout("a") == [5, 6, 7]
    assert table.expire(now_s=100.0) == []  # being read: not expired
    assert table.next_deadline_s() is None
    assert table.end("a") == (True, False)  # deferred to checkin
    with pytest.raises(KeyError):
        table.checkout("a")  # ended: no new readers
    assert table.checkin("a") is True  # the caller frees now
    assert len(table) == 0


def test_checkin_without_end_keeps_lease() -> None:
    table = LeaseTable(lease_s=10.0)
    table.grant("a", [1], now_s=0.0, token="t")
    table.checkout("a")
    table.checkout("a")
    assert table.checkin("a") is False
    assert table.checkin("a") is False
    assert table.expire(now_s=10.0) == ["a"]


def test_grant_twice_and_bad_lease() -> None:
    table = LeaseTable(lease_s=1.0)
    table.grant("a", [1], now_s=0.0, token="t")
    with pytest.raises(KeyError, match="already holds a lease"):
        table.grant("a", [2], now_s=0.0, token="t")
    with pytest.raises(ValueError, match="lease_s"):
        LeaseTable(lease_s=0)


def test_a_wrong_token_reads_ends_and_renews_nothing() -> None:
    table = LeaseTable(lease_s=10.0)
    table.grant("a", [4, 5], now_s=0.0, token="secret")
    with pytest.raises(KeyError):
        table.checkout("a", "guess")
    assert not table.renew("a", now_s=5.0, token="guess")
    assert table.end("a", "guess") == (False, False)
    assert len(table) == 1  # untouched
    assert table.checkout("a", "secret") == [4, 5]
    assert table.renew("a", now_s=5.0, token="secret")
    assert table.end("a", "secret") == (True, False)
    assert table.checkin("a") is True
