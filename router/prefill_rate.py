"""What the router measures of the pool that computes prompts, for admission's prediction
(``router/admission.py``): the prompt tokens per second it serves while it has work, and the
part of a time to first token that is neither that work nor waiting for it. Pure: the clock is
the caller's (the waiting room's, ``router/waiting_room.py``).

The rate is ``tokens served / seconds busy``, both decayed with a half-life, so it follows the
pool as it changes (workers join, prompts get cached). A busy second is one in which any
prompt the router sent had no first token back: so the rate is the one the router's own queue
drains at, at the concurrency it keeps, which is what the prediction needs. Until it has
measured, it reads a prior (``--prefill-tokens-per-s`` per worker) as one second of work.

What is left of the work in flight is tracked as a virtual queue: each prompt sent moves the
time the pool drains to ``max(drain, now) + its tokens / rate``, and a first token back caps it
at ``now + what is still in flight / rate``. So a prompt sent long ago counts only its part
not yet computed: a request behind a prompt about to finish is predicted to wait little.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from router.ttft_fit import Correction, TtftFit

_PRIOR_S = 1.0  # the prior weighs as much as this many measured busy seconds
_OVERHEAD_WEIGHT = 0.1  # each sample's weight in the overhead's moving average


@dataclass
class PrefillRate:
    prior_tokens_per_s: float  # per worker
    half_life_s: float = 30.0
    _tokens: float = 0.0
    _busy_s: float = 0.0
    _last_s: float | None = None
    _inflight: int = 0  # prompt tokens sent, first token not back
    _drain_s: float = 0.0  # when the work in flight is predicted done (the virtual queue)
    overhead_s: float = 0.0
    # Per request class: how its measured TTFTs fit admission's formula (router/ttft_fit.py).
    _fits: dict[str, TtftFit] = field(default_factory=dict)

    def _advance(self, now_s: float) -> None:
        if self._last_s is not None and now_s > self._last_s:
            elapsed = now_s - self._last_s
            keep = 0.5 ** (elapsed / self.half_life_s)
            self._tokens *= keep
            # Busy time decays as it accrues: the integral of the decay over the interval.
            if self._inflight > 0:
                self._busy_s = self._busy_s * keep + (1 - keep) * self.half_life_s / _LN2
            else:
                self._busy_s *= keep
        self._last_s = now_s if self._last_s is None else max(self._last_s, now_s)

    def sent(self, tokens: int, now_s: float, num_workers: int = 1) -> None:
        """A prompt of ``tokens`` went to the pool (of ``num_workers``)."""
        self._advance(now_s)
        self._inflight += tokens
        self._drain_s = max(self._drain_s, now_s) + tokens / self.tokens_per_s(num_workers)

    def served(self, tokens: int, now_s: float, num_workers: int = 1) -> None:
        """Its first token came back: the pool computed it."""
        self._advance(now_s)
        self._inflight -= tokens
        self._tokens += tokens
        self._cap_drain(now_s, num_workers)

    def dropped(self, tokens: int, now_s: float, num_workers: int = 1) -> None:
        """It ended without a first token (an error, the client gone): no work measured."""
        self._advance(now_s)
        self._inflight -= tokens
        self._cap_drain(now_s, num_workers)

    def _cap_drain(self, now_s: float, num_workers: int) -> None:
        rest = max(0, self._inflight) / self.tokens_per_s(num_workers)
        self._drain_s = min(self._drain_s, now_s + rest)

    def pending_tokens(self, now_s: float, num_workers: int) -> int:
        """The prompt tokens in flight predicted not yet computed at ``now_s`` (at most all
        in flight; none once the virtual queue has drained, however late the pool is)."""
        left = max(0.0, self._drain_s - now_s) * self.tokens_per_s(num_workers)
        return min(max(0, self._inflight), math.ceil(left - 1e-9))

    @property
    def inflight_tokens(self) -> int:
        return self._inflight

    def tokens_per_s(self, num_workers: int) -> float:
        """The pool's measured rate, the prior (for ``num_workers``) weighed in."""
        prior = self.prior_tokens_per_s * max(1, num_workers)
        return (self._tokens + prior * _PRIOR_S) / (self._busy_s + _PRIOR_S)

    def observe_overhead(self, first_token_s: float, work_tokens: int, num_workers: int) -> None:
        """One request's time from leaving the router's queue to its first token,
        ``first_token_s``, when ``work_tokens`` (the backlog it found and its own) were ahead
        of it: what the rate does not explain is overhead (never below zero)."""
        sample = max(0.0, first_token_s - work_tokens / self.tokens_per_s(num_workers))
        self.overhead_s += _OVERHEAD_WEIGHT * (sample - self.overhead_s)

    def correction(self, request_class: str) -> Correction:
        fit = self._fits.get(request_class)
        return fit.correction() if fit is not None else Correction()

    def observe_ttft(self, request_class: str, formula_s: float, measured_s: float) -> None:
        """One admitted request of ``request_class``: the formula's TTFT when it was admitted
        and the TTFT it measured."""
        self._fits.setdefault(request_class, TtftFit()).observe(formula_s, measured_s)


_LN2 = 0.6931471805599453
