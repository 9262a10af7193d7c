"""Leases on prefilled requests' blocks: pure bookkeeping, clock passed in (no torch, no I/O).

A lease ends in exactly one of three ways, and the caller frees the blocks exactly once, when a
method says so: ``end`` (decode confirmed, or gave up, or the request was aborted), or
``expire`` (nobody came). While a sender has the request checked out, neither ``end`` nor
expiry frees it; the free is deferred to the last ``checkin``. The rule this serves is the
block-ownership contract in ``kvtransfer/base.py``.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass


@dataclass
class _Lease:
    block_ids: list[int]
    deadline_s: float
    token: str
    num_readers: int = 0
    ended: bool = False


class LeaseTable:
    def __init__(self, lease_s: float) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.lease_s = lease_s
        self._leases: dict[str, _Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, request_id: str, block_ids: list[int], now_s: float, token: str) -> None:
        if request_id in self._leases:
            raise KeyError(f"request_id {request_id!r} already holds a lease")
        self._leases[request_id] = _Lease(list(block_ids), now_s + self.lease_s, token)

    def _live(self, request_id: str, token: str | None) -> _Lease | None:
        """The live lease, if ``token`` is its token (None: the owner asks, no token needed)."""
        lease = self._leases.get(request_id)
        if lease is None or lease.ended:
            return None
        if token is not None and not hmac.compare_digest(token.encode(), lease.token.encode()):
            return None
        return lease

    def renew(self, request_id: str, now_s: float, token: str | None = None) -> bool:
        lease = self._live(request_id, token)
        if lease is None:
            return False
        lease.deadline_s = max(lease.deadline_s, now_s + self.lease_s)
        return True

    def checkout(self, request_id: str, token: str | None = None) -> list[int]:
        """Block ids of a live lease, pinned until ``checkin``. KeyError if none (or the
        token is wrong)."""
        lease = self._live(request_id, token)
        if lease is None:
            raise KeyError(request_id)
        lease.num_readers += 1
        return list(lease.block_ids)

    def checkin(self, request_id: str) -> bool:
        """True when the caller must now free the blocks (ended while checked out)."""
        lease = self._leases[request_id]
        lease.num_readers -= 1
        return self._drop_if_done(request_id, lease)

    def end(self, request_id: str, token: str | None = None) -> tuple[bool, bool]:
        """(was leased, free now). A second end of the same lease, or a wrong token, is
        (False, False)."""
        lease = self._live(request_id, token)
        if lease is None:
            return False, False
        lease.ended = True
        return True, self._drop_if_done(request_id, lease)

    def expire(self, now_s: float) -> list[str]:
        """Leases past their deadline and not checked out: dropped; the caller frees them."""
        expired = [
            rid
            for rid, lease in self._leases.items()
            if not lease.ended and lease.num_readers == 0 and lease.deadline_s <= now_s
        ]
        for rid in expired:
            del self._leases[rid]
        return expired

    def next_deadline_s(self) -> float | None:
        live = [
            lease.deadline_s
            for lease in self._leases.values()
            if not lease.ended and lease.num_readers == 0
        ]
        return min(live, default=None)

    def _drop_if_done(self, request_id: str, lease: _Lease) -> bool:
        if lease.ended and lease.num_readers == 0:
            del self._leases[request_id]
            return True
        return False
