"""One try at a request on the workers, and what it reports besides tokens.

An attempt (``router/generation.py``) is an async stream of ``Chunk``s for the client and
typed facts for the request's final message: ``Prefilled``, ``Transferred``, ``CacheHits`` and,
last, ``Ended``. It mutates nothing shared; the request folds the facts of its attempts into a
``Report`` (``Report.add``, pure). An attempt that loses its worker raises ``WorkerLost`` (the
verdict says why, ``router/failures.py``); one a local worker turns away raises ``TurnedAway``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TypeAlias

from pdserve.v1 import common_pb2
from router.migration import Continuation
from router.plan import Route
from router.result import Chunk


@dataclass(frozen=True)
class Attempt:
    """What one try asks for: its id on the workers, the continuation, whom to avoid, and the
    request's sampling as its worker calls carry it (serialised once per request)."""

    request_id: str
    continuation: Continuation
    sampling: common_pb2.SamplingParams
    avoid: frozenset[str]

    @property
    def of_the_client_prompt(self) -> bool:
        """Nothing generated yet: cache hits are of the client's prompt, not a continuation."""
        return self.continuation.num_generated_tokens == 0


@dataclass(frozen=True)
class Prefilled:
    """A prefill worker prefilled the attempt's prompt."""

    seconds: float
    cached_tokens: int  # of the client's prompt; 0 for a continuation


@dataclass(frozen=True)
class Transferred:
    """A decode worker admitted the attempt and pulled its KV."""

    seconds: float


@dataclass(frozen=True)
class CacheHits:
    """A local worker served this many of the client's prompt tokens from its cache."""

    tokens: int


@dataclass(frozen=True)
class Ended:
    """The attempt's last event: how the request ended ("stop", "length"; None: the worker
    said nothing of it), and the route it took (None: it ended before any worker took it)."""

    finish_reason: str | None
    route: Route | None = None


AttemptEvent: TypeAlias = Chunk | Prefilled | Transferred | CacheHits | Ended


class TurnedAway(Exception):
    """A local worker could not take the attempt now (a ``NEXT`` verdict): not a failure."""


@dataclass(frozen=True)
class Report:
    """A request's facts over all its attempts, for its final message."""

    finish_reason: str | None = None
    cached_tokens: int = 0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    route: Route | None = None

    def add(self, event: Prefilled | Transferred | CacheHits | Ended) -> Report:
        """This report with one more fact. Times add up over attempts (a migration's prefill
        costs time too); cache hits are the client prompt's, the most any worker reported."""
        if isinstance(event, Prefilled):
            return dataclasses.replace(
                self,
                prefill_s=self.prefill_s + event.seconds,
                cached_tokens=max(self.cached_tokens, event.cached_tokens),
            )
        if isinstance(event, Transferred):
            return dataclasses.replace(self, transfer_s=self.transfer_s + event.seconds)
        if isinstance(event, CacheHits):
            return dataclasses.replace(self, cached_tokens=max(self.cached_tokens, event.tokens))
        # An end without a worker (what the client has ends it) keeps the last route.
        route = event.route if event.route is not None else self.route
        return dataclasses.replace(self, finish_reason=event.finish_reason, route=route)
