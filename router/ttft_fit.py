"""How admission's TTFT formula (``router/admission.py``) maps onto what a class's requests
measure: ``measured ≈ intercept + slope x formula``, an exponentially weighted least-squares
fit per request class, over its admitted requests. Pure: the waiting room feeds it.

Why a line and not a ratio: an engine batches the prompts it holds, so the work in flight
that the formula counts ahead of a request delays it far less than its whole compute, and
for a class served first (the most urgent band) hardly at all. Its TTFT is then nearly
constant while the formula's value swings with the backlog: a ratio fits one backlog only,
a line fits both (as Dynamo's planner corrects its profile by observed over expected, per
quantity). Until a class has ``MIN_SAMPLES`` requests, or while their formula values barely
differ, the fit is the identity or a ratio through zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_SLOPE = 4.0
MIN_SAMPLES = 8
_KEEP = 0.95  # each new sample's forgetting factor on the older ones
_FLAT = 1e-6  # a spread of formula values (s^2) below this fits no slope


@dataclass(frozen=True)
class Correction:
    """``intercept_s + slope x formula``: the identity by default."""

    intercept_s: float = 0.0
    slope: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.intercept_s) and self.intercept_s >= 0):
            raise ValueError(f"intercept_s must be finite and >= 0, got {self.intercept_s}")
        if not 0 <= self.slope <= MAX_SLOPE:
            raise ValueError(f"slope must be in [0, {MAX_SLOPE}], got {self.slope}")

    def __call__(self, formula_s: float) -> float:
        return self.intercept_s + self.slope * formula_s


class TtftFit:
    def __init__(self) -> None:
        self.samples = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, formula_s: float, measured_s: float) -> None:
        """One admitted request: the formula's value when it was admitted, its TTFT."""
        if not (math.isfinite(formula_s) and math.isfinite(measured_s)):
            return
        self.samples += 1
        k = _KEEP
        self._w = k * self._w + 1.0
        self._x = k * self._x + formula_s
        self._y = k * self._y + measured_s
        self._xx = k * self._xx + formula_s * formula_s
        self._xy = k * self._xy + formula_s * measured_s

    def correction(self) -> Correction:
        if self.samples < MIN_SAMPLES or self._x <= 0:
            return Correction()
        spread = self._w * self._xx - self._x * self._x
        if spread <= _FLAT * self._w * self._w:  # one formula value: a ratio through zero
            return Correction(0.0, _clip(self._y / self._x))
        slope = _clip((self._w * self._xy - self._x * self._y) / spread)
        intercept = max(0.0, (self._y - slope * self._x) / self._w)
        return Correction(intercept, slope)


def _clip(slope: float) -> float:
    return min(MAX_SLOPE, max(0.0, slope))
