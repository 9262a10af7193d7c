"""Poison requests: a request that makes the worker running it die must not take the pool down,
and a loss it did not cause must not lock anyone out.

Strikes go to the *request*: the caller (``RequestCore.caller``: its API key, else its host),
the prompt and the sampling parameters (``request_digest``), the same for every attempt of it
(migrations continue it). What a loss says, the failure table decides (``router/failures.py``):
- The dead worker's last words name the request as alone in the engine step that failed
  (``QUARANTINE``): it is the cause. The request ends with a named INTERNAL error and is
  refused (``condemn``) for ``quarantine_s``: it cost one worker.
- A silent loss (the process or connection gone: a kill, an OOM kill, a segfault): the router
  cannot tell a kill from a crash the request caused, so it is one *strike*, and the request
  migrates. A strike from a second, distinct worker within ``quarantine_s`` ends it with a
  named INTERNAL error, and the same request is refused until the strikes expire: a poison
  request that kills silently costs at most two workers, before or after its first token,
  however many workers and retries there are.
- The last words say it was one of several in the failed step, or not in it; the worker
  stalled, or was draining: no strike. Which of several caused a fault cannot be said, and
  striking them all would end the innocents batched twice with a poison; ``migration_limit``
  bounds what such a fault costs.
One crash seen by several attempts with the same digest (``n`` identical choices) is one
strike: strikes count distinct workers. Another caller, or another prompt or sampling, has
strikes of its own: nobody else's request is refused for this one's losses.

Per router process, bounded (oldest entries go first), pure apart from the clock.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.sampling_params import SamplingParams

POISON_STRIKES = 2
_MAX_REQUESTS = 4096


def request_digest(caller: str, prompt_ids: Sequence[int], params: SamplingParams) -> str:
    """What strikes count against: one caller's prompt with its sampling parameters."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(caller.encode() + b"\0")
    # The router imports no numpy (tests/unit/test_layering.py): the stdlib packs the ids.
    digest.update(array("q", prompt_ids).tobytes())
    digest.update(repr(params).encode())  # a frozen dataclass of plain values: deterministic
    return digest.hexdigest()


@dataclass
class _Strikes:
    workers: frozenset[str]  # the distinct workers lost running the request
    expires: float
    condemned: bool = False  # a worker's last words named it as the cause


class Quarantine:
    def __init__(
        self,
        quarantine_s: float,
        max_requests: int = _MAX_REQUESTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.quarantine_s = quarantine_s
        self.max_requests = max_requests
        self._clock = clock
        self._strikes: OrderedDict[str, _Strikes] = OrderedDict()

    def strikes(self, digest: str) -> int:
        entry = self._entry(digest)
        return len(entry.workers) if entry is not None else 0

    def quarantined(self, digest: str) -> bool:
        entry = self._entry(digest)
        return entry is not None and (entry.condemned or len(entry.workers) >= POISON_STRIKES)

    def strike(self, digest: str, worker: str) -> int:
        """Records ``worker`` lost running the request; returns its strikes now (distinct
        workers)."""
        entry = self._entry(digest)
        workers = (entry.workers if entry is not None else frozenset()) | {worker}
        self._put(digest, _Strikes(workers, self._clock() + self.quarantine_s))
        return len(workers)

    def condemn(self, digest: str, worker: str) -> None:
        """A worker's last words name the request as what killed it: refused from now on,
        for ``quarantine_s``."""
        entry = self._entry(digest)
        workers = (entry.workers if entry is not None else frozenset()) | {worker}
        self._put(digest, _Strikes(workers, self._clock() + self.quarantine_s, condemned=True))

    def _entry(self, digest: str) -> _Strikes | None:
        entry = self._strikes.get(digest)
        if entry is not None and entry.expires <= self._clock():
            del self._strikes[digest]
            return None
        return entry

    def _put(self, digest: str, entry: _Strikes) -> None:
        self._strikes.pop(digest, None)
        self._strikes[digest] = entry
        while len(self._strikes) > self.max_requests:
            self._strikes.popitem(last=False)
