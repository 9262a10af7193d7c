"""The router's waiting room (docs/slo.md): requests admitted but not yet sent to a worker, in
priority bands, each band's requests in a queue per fairness key, served by deficit round
robin on prompt tokens. Deterministic, no I/O, the clock is the caller's: the router's shell
pushes what admission let in (``router/admission.py``) and sends what ``release`` returns.

The discipline, written once:
- **Bands.** A lower priority value is served first (vLLM's rule); a band is served only while
  every more urgent band is empty. Priority does not reserve capacity: it orders the wait.
- **Fairness within a band.** Keys take turns; each turn adds ``quantum_tokens x weight`` to
  the key's deficit, and the key sends its oldest requests while their prompt tokens fit in
  it. A key that floods gets its share of the band's prompt tokens, not the band. A key whose
  queue empties leaves the turn order and forgets its deficit (no credit hoarded while idle).
- **Time to live.** A request still waiting at its class's ``queue_ttl_s`` is shed: it would
  wait only to miss. So a low band can wait, never starve unseen: it is shed, and counted.
- **Release.** Requests go to the workers while the prompt tokens in flight there stay within
  the bound the shell gives (at least one when none is in flight: a request larger than the
  bound still runs), and, when the shell bounds them, while fewer requests run there (sent,
  not ended) than its bound: a worker's decode batch is load too. A request whose class has a
  ``load_share`` below 1 goes only while what is in flight fits that share of each bound: the
  rest is kept for the others (a more urgent request finds room at once).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

MIN_WEIGHT, MAX_WEIGHT = 1 / 64, 64.0


@dataclass(frozen=True)
class Ticket:
    """One waiting request."""

    request_id: str
    key: str  # its fairness key
    band: int  # its priority: lower is served first
    cost: int  # its prompt tokens (what fairness shares and the prediction counts)
    arrival_s: float
    deadline_s: float  # shed when still waiting at this time (arrival + its class's TTL)
    share: float = 1.0  # of the release bounds it may go within (its class's load_share)

    def __post_init__(self) -> None:
        if self.cost < 1:
            raise ValueError(f"a ticket costs >= 1 prompt token, got {self.cost}")
        if not 0 < self.share <= 1:
            raise ValueError(f"a ticket's share is in (0, 1], got {self.share}")


@dataclass
class _Band:
    queues: dict[str, deque[Ticket]] = field(default_factory=dict)
    turns: deque[str] = field(default_factory=deque)  # keys with requests, in turn order
    deficit: dict[str, float] = field(default_factory=dict)
    opened: bool = False  # the key first in turn had its quantum for this turn
    tokens: int = 0  # prompt tokens waiting in the band
    key_tokens: dict[str, int] = field(default_factory=dict)  # and per key


@dataclass(frozen=True)
class Release:
    """What the shell does now: send ``dispatch`` to the workers in this order, and refuse
    ``shed`` (their time to live ran out)."""

    dispatch: tuple[Ticket, ...]
    shed: tuple[Ticket, ...]


class FlowQueues:
    def __init__(self, quantum_tokens: int = 512, weights: Mapping[str, float] | None = None):
        """``weights``: a key's share against the others of its band (1 if unnamed)."""
        if quantum_tokens < 1:
            raise ValueError(f"quantum_tokens must be >= 1, got {quantum_tokens}")
        self.quantum_tokens = quantum_tokens
        self.weights: dict[str, float] = {}
        for key, weight in (weights or {}).items():
            self.set_weight(key, weight)
        self._bands: dict[int, _Band] = {}
        self._where: dict[str, Ticket] = {}
        # (deadline, request id), a heap: what to shed is found without a scan. An entry
        # whose request left the queue stays until its deadline comes (then it is skipped).
        self._deadlines: list[tuple[float, str]] = []

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._where

    def next_deadline_s(self) -> float | None:
        """When ``release`` may next shed (none waits: None). A deadline of a request that
        left may be early: releasing then sheds nothing."""
        return self._deadlines[0][0] if self._deadlines else None

    def set_weight(self, key: str, weight: float | None) -> None:
        """``key``'s share from now on (its next turn's quantum; None: the default, 1).
        Raises ValueError."""
        if weight is None:
            self.weights.pop(key, None)
            return
        if not MIN_WEIGHT <= weight <= MAX_WEIGHT:
            raise ValueError(
                f"the weight of {key!r} must be in [{MIN_WEIGHT}, {MAX_WEIGHT}], got {weight}"
            )
        self.weights[key] = weight

    def weight(self, key: str) -> float:
        return self.weights.get(key, 1.0)

    def _quantum(self, key: str) -> float:
        """What one turn adds to ``key``'s deficit."""
        return self.quantum_tokens * self.weight(key)

    def push(self, ticket: Ticket) -> None:
        """Raises ValueError for a request id already waiting."""
        if ticket.request_id in self._where:
            raise ValueError(f"request {ticket.request_id!r} is already waiting")
        band = self._bands.setdefault(ticket.band, _Band())
        queue = band.queues.get(ticket.key)
        if queue is None:
            queue = band.queues[ticket.key] = deque()
            band.turns.append(ticket.key)
            band.deficit[ticket.key] = 0.0
        queue.append(ticket)
        band.tokens += ticket.cost
        band.key_tokens[ticket.key] = band.key_tokens.get(ticket.key, 0) + ticket.cost
        self._where[ticket.request_id] = ticket
        if len(self._deadlines) > 2 * len(self._where) + 64:  # mostly gone: rebuilt
            self._deadlines = [(t.deadline_s, t.request_id) for t in self._where.values()]
            heapq.heapify(self._deadlines)
        heapq.heappush(self._deadlines, (ticket.deadline_s, ticket.request_id))

    def remove(self, request_id: str) -> Ticket | None:
        """Takes a waiting request out (its client left); None if it is not waiting."""
        ticket = self._where.get(request_id)
        if ticket is None:
            return None
        band = self._bands[ticket.band]
        band.queues[ticket.key].remove(ticket)
        self._taken(band, ticket)
        return ticket

    def pop(self) -> Ticket | None:
        """The next request to serve (None: none waits)."""
        if not self._bands:
            return None
        band = self._bands[min(self._bands)]
        head, band.opened = self._turn(band, band.turns, band.deficit, band.opened)
        band.queues[head.key].popleft()
        band.deficit[head.key] -= head.cost
        self._taken(band, head)
        return head

    def release(
        self,
        now_s: float,
        inflight_tokens: int,
        max_inflight_tokens: int,
        running: int = 0,
        max_running: int = 0,
    ) -> Release:
        """Sheds what waited past its deadline, then picks what may go to the workers now:
        while the prompt tokens in flight stay within ``max_inflight_tokens`` and the
        requests running (sent, not ended) below ``max_running`` (0: no bound), each bound
        scaled by the next request's share (a running bound by at least one request)."""
        shed: list[Ticket] = []
        while self._deadlines and self._deadlines[0][0] <= now_s:
            deadline_s, request_id = heapq.heappop(self._deadlines)
            waiting = self._where.get(request_id)
            # Skipped: it left the queue before (or left, and came back with a later one).
            if waiting is not None and waiting.deadline_s == deadline_s:
                self.remove(request_id)
                shed.append(waiting)
        dispatch: list[Ticket] = []
        while self._where:
            if max_running and running >= max_running:
                break  # full for every share: no peek needed
            following = self._peek()
            if max_running and running >= max(1, math.floor(max_running * following.share)):
                break
            tokens_bound = max_inflight_tokens * following.share
            if inflight_tokens > 0 and inflight_tokens + following.cost > tokens_bound:
                break
            popped = self.pop()
            assert popped is following
            dispatch.append(popped)
            inflight_tokens += popped.cost
            running += 1
        return Release(tuple(dispatch), tuple(shed))

    def tokens_ahead(self, band: int, key: str, cost: int) -> int:
        """The prompt tokens served before a request of ``cost`` tokens that ``key`` would
        push into ``band`` now, if nothing else arrived: every more urgent band's, its own
        key's queue, and of each other key of its band what its turns send meanwhile, at
        most (its quantum in each of the rounds its own key needs)."""
        ahead = sum(b.tokens for priority, b in self._bands.items() if priority < band)
        own_band = self._bands.get(band)
        if own_band is None:
            return ahead
        own = own_band.key_tokens.get(key, 0) + cost
        ahead += own - cost
        rounds = math.ceil(own / self._quantum(key))
        for other, queued in own_band.key_tokens.items():
            if other != key:
                ahead += min(queued, math.ceil(rounds * self._quantum(other)))
        return ahead

    def waiting(self, band: int | None = None) -> int:
        """Requests waiting (in ``band``, or in all)."""
        if band is None:
            return len(self._where)
        found = self._bands.get(band)
        return sum(len(q) for q in found.queues.values()) if found else 0

    def _taken(self, band: _Band, ticket: Ticket) -> None:
        del self._where[ticket.request_id]
        band.tokens -= ticket.cost
        band.key_tokens[ticket.key] -= ticket.cost
        if not band.queues[ticket.key]:
            del band.queues[ticket.key]
            del band.deficit[ticket.key]
            del band.key_tokens[ticket.key]
            if band.turns[0] == ticket.key:
                band.opened = False  # its turn ends with its queue
            band.turns.remove(ticket.key)
        if not band.queues:
            del self._bands[ticket.band]

    def _peek(self) -> Ticket:
        """What ``pop`` would return, the turn state untouched."""
        band = self._bands[min(self._bands)]
        head, _ = self._turn(band, deque(band.turns), dict(band.deficit), band.opened)
        return head

    def _turn(
        self, band: _Band, turns: deque[str], deficit: dict[str, float], opened: bool
    ) -> tuple[Ticket, bool]:
        """Deficit round robin, one request at a time: the key first in turn gets its quantum
        once per turn and sends its oldest request if it fits; else the turn passes. Moves
        ``turns`` and ``deficit``; returns the request and whether the turn is open."""
        if not opened:
            # Whole rounds in which no key's oldest request fits are given at once: a long
            # prompt costs one pass over the keys, not one per quantum it needs.
            short = {k: band.queues[k][0].cost - deficit[k] for k in turns}
            need = min(math.ceil(short[k] / self._quantum(k)) for k in turns)
            if need > 1:
                for k in turns:
                    deficit[k] += (need - 1) * self._quantum(k)
        while True:
            key = turns[0]
            if not opened:
                deficit[key] += self._quantum(key)
                opened = True
            head = band.queues[key][0]
            if head.cost <= deficit[key]:
                return head, opened
            turns.rotate(-1)
            opened = False
