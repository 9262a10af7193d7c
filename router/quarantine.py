"""Poison prompts: a prompt that makes the worker running it die must not take the pool down.

A worker that goes away (``Verdict.gone``) before the request's first token came out was
killed, crashed on its own, or crashed on this prompt: the router cannot tell which. So one
such loss is a *strike* against the prompt's digest, and the request migrates as it would
after any loss (a kill -9 during a prefill is retried). A strike from a second, distinct
worker (this request's next one, or one serving any later request with the same prompt
within ``quarantine_s``) ends it with a named INTERNAL error, and until the strikes expire the
prompt is refused before any worker sees it. A loss after tokens came out is no strike: the
prompt itself was prefilled fine. A poison prompt so costs at most two workers per
``quarantine_s`` (one cannot be had while a killed worker's prefill is still retried), however
many workers and retries there are.

Per router process, bounded (oldest entries go first), pure apart from the clock.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

POISON_STRIKES = 2
_MAX_PROMPTS = 4096


def prompt_digest(prompt_ids: Sequence[int]) -> str:
    # The router imports no numpy (tests/unit/test_layering.py): the stdlib packs the ids.
    return hashlib.blake2b(array("q", prompt_ids).tobytes(), digest_size=16).hexdigest()


@dataclass
class _Strikes:
    workers: frozenset[str]  # the distinct workers lost running the prompt
    expires: float


class Quarantine:
    def __init__(
        self,
        quarantine_s: float,
        max_prompts: int = _MAX_PROMPTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.quarantine_s = quarantine_s
        self.max_prompts = max_prompts
        self._clock = clock
        self._strikes: OrderedDict[str, _Strikes] = OrderedDict()

    def strikes(self, digest: str) -> int:
        return len(self._workers(digest))

    def _workers(self, digest: str) -> frozenset[str]:
        entry = self._strikes.get(digest)
        if entry is None:
            return frozenset()
        if entry.expires <= self._clock():
            del self._strikes[digest]
            return frozenset()
        return entry.workers

    def quarantined(self, digest: str) -> bool:
        return self.strikes(digest) >= POISON_STRIKES

    def strike(self, digest: str, worker: str) -> int:
        """Records ``worker`` lost before the prompt's first token; returns the prompt's
        strikes now: distinct workers, so one crash seen by several requests of the same
        prompt (``n`` choices, a popular prompt) is one strike."""
        workers = self._workers(digest) | {worker}
        self._strikes.pop(digest, None)
        self._strikes[digest] = _Strikes(workers, self._clock() + self.quarantine_s)
        while len(self._strikes) > self.max_prompts:
            self._strikes.popitem(last=False)
        return len(workers)
