"""The router's admission (docs/slo.md): whether a public request may wait for a worker, decided
the moment it arrives, before any worker work. Pure: the shell gives it the request's tag and
size, what waits ahead of it (``FlowQueues.tokens_ahead``) and the pool's measured rate.

The rule, written once:
- no worker can take it: refused, 503 (``UNAVAILABLE``);
- its class's queue is full: shed, 429 (``RESOURCE_EXHAUSTED``), with a Retry-After of the
  time the queue ahead of it takes to drain;
- it has a TTFT target, work is ahead of it (in flight or waiting), and its predicted TTFT
  misses the target: refused at once, 429, with a Retry-After of the time until enough of the
  work ahead has drained for it to be met (it would otherwise wait only to miss). With nothing
  ahead it is admitted whatever the prediction: going now is the best it can get, a retry
  could do no better, and only what runs is measured (a prior rate set too low would
  otherwise refuse every request, and never learn);
- else admitted, with its prediction (compared with what it measures: the prediction's error
  is a histogram).

The prediction: ``correction(overhead_s + (backlog_tokens + tokens_ahead + its own) / rate)``,
the backlog being the prompt tokens sent to the pool and not yet computed (what is in flight,
less the part the pool's virtual queue says it has done: ``PrefillRate.pending_tokens``), the rate
the pool's measured prompt tokens per second, the overhead what a request's time from leaving
the router's queue to its first token measures besides that work, and the correction the line
its class's measured TTFTs fit against this formula (``router/ttft_fit.py``).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from router.request_class import Tag
from router.ttft_fit import Correction


class Verdict(enum.Enum):
    ADMIT = "admit"
    QUEUE_FULL = "queue_full"  # 429
    SLO_UNREACHABLE = "slo_unreachable"  # 429
    NO_WORKER = "no_worker"  # 503

    @property
    def http_status(self) -> int:
        return {Verdict.ADMIT: 200, Verdict.NO_WORKER: 503}.get(self, 429)


@dataclass(frozen=True)
class PoolRate:
    """What the router measures of the pool that computes prompts (the prefill pool, or the
    decode pool when colocated)."""

    prefill_tokens_per_s: float  # > 0
    overhead_s: float  # a TTFT's part that is neither queueing nor prompt compute
    backlog_tokens: int  # sent to the pool, predicted not yet computed
    num_workers: int
    correction: Correction = field(default_factory=Correction)  # its class's measured fit

    def __post_init__(self) -> None:
        rate = self.prefill_tokens_per_s
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"prefill_tokens_per_s must be finite and > 0, got {rate}")
        if not (math.isfinite(self.overhead_s) and self.overhead_s >= 0):
            raise ValueError(f"overhead_s must be finite and >= 0, got {self.overhead_s}")
        if self.backlog_tokens < 0 or self.num_workers < 0:
            raise ValueError("backlog_tokens and num_workers must be >= 0")

    def seconds(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s


@dataclass(frozen=True)
class Admission:
    verdict: Verdict
    predicted_ttft_s: float
    retry_after_s: int  # whole seconds (the header's unit), >= 1; 0 when admitted
    reason: str  # for the refusal's message and the log
    formula_ttft_s: float = 0.0  # the formula's, before the correction (what the fit learns from)

    @property
    def admitted(self) -> bool:
        return self.verdict is Verdict.ADMIT


def admit(
    tag: Tag, cost: int, tokens_ahead: int, queued_in_class: int, rate: PoolRate
) -> Admission:
    """The admission of a request of ``cost`` prompt tokens, ``tokens_ahead`` waiting before it
    in the router and ``queued_in_class`` requests of its class waiting there."""
    work = rate.backlog_tokens + tokens_ahead + cost
    formula = rate.overhead_s + rate.seconds(work)
    predicted = rate.correction(formula)
    if rate.num_workers == 0:
        return Admission(Verdict.NO_WORKER, predicted, 1, "no worker is available", formula)
    cls = tag.request_class
    if queued_in_class >= cls.max_queued:
        drain = rate.correction.slope * rate.seconds(rate.backlog_tokens + tokens_ahead)
        reason = f"class {cls.name!r} has {queued_in_class} requests waiting (its max_queued)"
        return Admission(Verdict.QUEUE_FULL, predicted, _whole(drain), reason, formula)
    target = tag.targets.ttft_s
    ahead = rate.backlog_tokens + tokens_ahead
    if target is not None and ahead > 0 and predicted > target:
        # Met once the work ahead is down to what ``target`` leaves time for.
        drain = predicted - target
        reason = (
            f"predicted time to first token {predicted:.3f} s misses its target {target:g} s "
            f"({work} prompt tokens ahead of its first token at "
            f"{rate.prefill_tokens_per_s:.0f} tokens/s)"
        )
        return Admission(Verdict.SLO_UNREACHABLE, predicted, _whole(drain), reason, formula)
    return Admission(Verdict.ADMIT, predicted, 0, "", formula)


def _whole(seconds: float) -> int:
    return max(1, math.ceil(seconds))
