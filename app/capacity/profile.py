"""A worker's measured cost model (``pdserve profile`` writes it, the simulator reads it): a
versioned JSON of linear fits with their residuals (pure: no I/O but ``load``/``save``).

Step time, one engine step of a batch (``StepShape``):
  prefill part = b1 x new prompt tokens + b2 x new tokens x context tokens / 1000
  decode part  = d1 x decode sequences + d2 x decode context tokens / 1000
  step_s = max(prefill intercept, decode intercept) + the parts present
Fitted from pure-prefill and pure-decode steps; a mixed (chunked) step adds both parts, with
one intercept (one model launch). KV transfer: a + bytes / bandwidth.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PROFILE_VERSION = 1
PREFILL_FEATURES = ("new_tokens", "new_x_context_k")
DECODE_FEATURES = ("num_seqs", "context_k")
TRANSFER_FEATURES = ("bytes",)


@dataclass(frozen=True)
class LinearFit:
    """``intercept + sum(coef_i * x_i)``, fitted by least squares; never predicts < 0."""

    features: tuple[str, ...]
    intercept: float
    coefficients: tuple[float, ...]
    rmse_s: float = 0.0  # of the fit on its own samples
    max_rel_residual: float = 0.0
    num_samples: int = 0

    def __post_init__(self) -> None:
        if len(self.features) != len(self.coefficients):
            raise ValueError(
                f"{len(self.features)} features, {len(self.coefficients)} coefficients"
            )

    def terms(self, x: Sequence[float]) -> float:
        """The fit without its intercept."""
        return sum(c * v for c, v in zip(self.coefficients, x, strict=True))

    def predict(self, x: Sequence[float]) -> float:
        return max(0.0, self.intercept + self.terms(x))


def _least_squares(design: list[list[float]], y: Sequence[float]) -> list[float]:
    """argmin |design @ beta - y|: the normal equations by Gaussian elimination with partial
    pivoting (a handful of parameters; no numpy, so the simulator stays light)."""
    k = len(design[0])
    a = [[sum(r[i] * r[j] for r in design) for j in range(k)] for i in range(k)]
    b = [sum(r[i] * t for r, t in zip(design, y, strict=True)) for i in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda i: abs(a[i][col]))
        if abs(a[pivot][col]) < 1e-300:
            raise ValueError("the samples cannot separate the fit's terms (collinear)")
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for i in range(k):
            if i != col and a[i][col]:
                f = a[i][col] / a[col][col]
                a[i] = [x - f * p for x, p in zip(a[i], a[col], strict=True)]
                b[i] -= f * b[col]
    return [b[i] / a[i][i] for i in range(k)]


def fit_linear(
    features: tuple[str, ...], rows: Sequence[Sequence[float]], times_s: Sequence[float]
) -> LinearFit:
    """Least squares over ``rows`` (one value per feature) -> ``times_s``; coefficients that
    come out negative (noise on a term that costs nothing) are dropped and the rest refitted."""
    if len(rows) != len(times_s) or len(rows) < len(features) + 1:
        raise ValueError(f"need > {len(features)} samples, got {len(rows)}")
    active = list(range(len(features)))
    while True:
        design = [[1.0, *(float(r[a]) for a in active)] for r in rows]
        solution = _least_squares(design, times_s)
        negative = [a for a, c in zip(active, solution[1:], strict=True) if c < 0]
        if not negative:
            break
        active = [a for a in active if a not in negative]
    coefficients = [0.0] * len(features)
    for a, c in zip(active, solution[1:], strict=True):
        coefficients[a] = c
    fit = LinearFit(features, solution[0], tuple(coefficients), num_samples=len(rows))
    errors = [fit.predict(r) - t for r, t in zip(rows, times_s, strict=True)]
    rel = [abs(e) / max(t, 1e-9) for e, t in zip(errors, times_s, strict=True)]
    rmse = math.sqrt(sum(e * e for e in errors) / len(errors))
    return LinearFit(features, fit.intercept, fit.coefficients, rmse, max(rel), len(rows))


@dataclass(frozen=True)
class StepShape:
    """One engine step's batch: the prompt chunks it computes and the decode tokens."""

    new_tokens: int = 0  # prompt tokens computed in this step (all chunks)
    new_x_context_k: float = 0.0  # sum over chunks: new tokens x (their context) / 1000
    num_decode_seqs: int = 0
    decode_context_k: float = 0.0  # sum over decode sequences of their context / 1000


@dataclass(frozen=True)
class Profile:
    prefill: LinearFit
    decode: LinearFit
    transfer: LinearFit
    kv_bytes_per_token: int
    block_size: int
    num_blocks: int  # one worker's KV cache
    max_num_seqs: int
    max_num_batched_tokens: int
    # Serving overheads the engine-only measurements do not see: the router's hops before a
    # first token, and a worker's per-step cost of streaming (calibrated from idle requests on
    # a running cluster; 0 when not calibrated).
    router_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    # A prefill worker's measured prefill over the profile's (its phases on a running cluster:
    # docs/observability.md); 1: as profiled.
    prefill_scale: float = 1.0
    model_fingerprint: str = ""
    dtype: str = ""
    hardware: dict[str, Any] = field(default_factory=dict)
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        if self.version != PROFILE_VERSION:
            raise ValueError(
                f"profile version {self.version}, this pdserve reads {PROFILE_VERSION}"
            )
        if self.num_blocks < 1 or self.block_size < 1 or self.max_num_seqs < 1:
            raise ValueError("profile: num_blocks, block_size and max_num_seqs must be >= 1")
        if not self.prefill_scale > 0:
            raise ValueError(f"profile: prefill_scale must be > 0, got {self.prefill_scale}")

    def step_s(self, shape: StepShape) -> float:
        parts = 0.0
        intercepts = []
        if shape.new_tokens:
            terms = self.prefill.terms((shape.new_tokens, shape.new_x_context_k))
            parts += terms * self.prefill_scale
            intercepts.append(self.prefill.intercept)
        if shape.num_decode_seqs:
            parts += self.decode.terms((shape.num_decode_seqs, shape.decode_context_k))
            intercepts.append(self.decode.intercept)
        if not intercepts:
            return 0.0
        return max(0.0, max(intercepts) + parts) + self.step_overhead_s

    def transfer_s(self, num_tokens: int) -> float:
        return self.transfer.predict((num_tokens * self.kv_bytes_per_token,))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        fits = {
            k: LinearFit(
                **{
                    **data[k],
                    "features": tuple(data[k]["features"]),
                    "coefficients": tuple(data[k]["coefficients"]),
                }
            )
            for k in ("prefill", "decode", "transfer")
        }
        return cls(**{**data, **fits})


def load(path: Path) -> Profile:
    try:
        return Profile.from_json(json.loads(path.read_text()))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a pdserve profile: {exc}") from None


def save(profile: Profile, path: Path) -> None:
    path.write_text(json.dumps(profile.to_json(), indent=2) + "\n")
