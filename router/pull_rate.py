"""What the router measures of peer pulls (docs/kv-cache.md), for the cost policy's price of one
(``router/prefix_pricing.py``): each pull's tokens and its seconds on the puller
(``PrefillResponse.num_pulled_tokens``, ``pull_s``) fit ``seconds = overhead + tokens / rate``,
the exponentially weighted line of ``router/ttft_fit.py``. Until the fit has its samples the
configured priors are the price; a fit without a slope prices every pull at its fixed time.
Pure: the dispatcher feeds it.
"""

from __future__ import annotations

import math

from router.ttft_fit import MIN_SAMPLES, TtftFit

_UNBOUNDED_TOKENS_PER_S = 1e12  # a rate the size of a pull never shows in


class PullRate:
    def __init__(self, prior_tokens_per_s: float, prior_overhead_s: float) -> None:
        self.prior = (prior_tokens_per_s, prior_overhead_s)
        self._fit = TtftFit()

    def observe(self, tokens: int, seconds: float) -> None:
        """One pull that landed ``tokens`` prompt tokens in ``seconds``."""
        if tokens > 0 and math.isfinite(seconds) and seconds > 0:
            self._fit.observe(float(tokens), seconds)

    @property
    def measured(self) -> bool:
        """Whether ``price`` is measured (else it is the priors)."""
        return self._fit.samples >= MIN_SAMPLES

    def price(self) -> tuple[float, float]:
        """(tokens per second, a pull's fixed seconds): measured, else the priors. A fit with
        no slope says the pulls' time does not grow with their size: all of it is fixed."""
        if self._fit.samples < MIN_SAMPLES:
            return self.prior
        line = self._fit.correction()
        if line.slope <= 0:
            return _UNBOUNDED_TOKENS_PER_S, line.intercept_s
        return min(_UNBOUNDED_TOKENS_PER_S, 1.0 / line.slope), line.intercept_s
