"""How big each pool should be next interval, and whether to change it now (pure: no I/O).

``desired_replicas`` turns a predicted load into pool sizes with the profile:
- prefill workers = rate x mean prompt tokens / (one worker's prefill tokens/s at a full step x
  ``utilization``), the profile's step time scaled by the prefill ``correction``;
- decode workers = the decode seats the load occupies (Little's law: rate x mean output tokens
  x step time) / the seats one worker can run within the TPOT SLO (its largest batch whose
  corrected step time meets it, and whose KV fits in its blocks).
Corrections are observed / expected latency (as Dynamo's planner does), bounded to
[``MIN_CORRECTION``, ``MAX_CORRECTION``], so a profile from other hardware or a drifted machine
is scaled to what the cluster really does.

``pressure_replicas`` reads the pools themselves (when a source reports them): the decode pool
at least as large as keeps its KV usage at ``kv_target`` (the saturation signal llm-d scales
on), the prefill pool at least as large as drains the prompt tokens queued on it within the
TTFT SLO. ``wanted_replicas`` takes the larger per pool and names the signal that set it.

``decide`` applies the policy: up at once; down only after ``down_after_intervals`` intervals
in a row below the current size and ``cooldown_s`` after the pool's last change; always within
the pool's bounds. Every decision carries its reason.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from app.capacity.profile import Profile, StepShape
from pdserve.common.role import Role

MIN_CORRECTION, MAX_CORRECTION = 0.25, 4.0


class Reason(enum.Enum):
    UP = "up"
    DOWN = "down"
    STEADY = "steady"
    HYSTERESIS = "hysteresis"  # below, not yet for long enough
    COOLDOWN = "cooldown"  # below for long enough, but the pool changed recently
    BOUNDS = "bounds"  # the load wants more (or fewer) than the pool's bounds allow


@dataclass(frozen=True)
class Bounds:
    min_replicas: int = 1
    max_replicas: int = 8

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas, got {self}")

    def clip(self, n: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, n))


@dataclass(frozen=True)
class ScalingPolicy:
    slo_ttft_s: float
    slo_tpot_s: float
    prefill: Bounds = Bounds()
    decode: Bounds = Bounds()
    interval_s: float = 30.0
    cooldown_s: float = 120.0
    down_after_intervals: int = 3
    utilization: float = 0.8  # the busy share a pool is sized for
    correct_profile: bool = True  # scale the profile by observed / expected latency
    kv_target: float = 0.75  # the decode pool's KV usage it is sized for (pressure)
    # The share of requests with a target (docs/slo.md) that must meet it: below, the pool
    # that target depends on grows (prefill for TTFT, decode for TPOT).
    slo_attainment: float = 0.95

    def __post_init__(self) -> None:
        if not (self.slo_ttft_s > 0 and self.slo_tpot_s > 0 and self.interval_s > 0):
            raise ValueError("SLOs and interval_s must be > 0")
        if not 0 < self.utilization <= 1:
            raise ValueError(f"utilization must be in (0, 1], got {self.utilization}")
        if self.cooldown_s < 0 or self.down_after_intervals < 1:
            raise ValueError("need cooldown_s >= 0 and down_after_intervals >= 1")
        if not 0 < self.kv_target <= 1:
            raise ValueError(f"kv_target must be in (0, 1], got {self.kv_target}")
        if not 0 < self.slo_attainment <= 1:
            raise ValueError(f"slo_attainment must be in (0, 1], got {self.slo_attainment}")

    def bounds(self, pool: Role) -> Bounds:
        return self.prefill if pool is Role.PREFILL else self.decode


@dataclass(frozen=True)
class Load:
    """One interval's load, as the routers' metrics show it."""

    time_s: float
    rate: float  # requests / s
    mean_prompt_tokens: float
    mean_output_tokens: float
    mean_ttft_s: float | None = None  # observed; None without finished requests
    mean_tpot_s: float | None = None
    # The pools now (None: no source reports them): the decode pool's share of KV blocks in
    # use, and the requests waiting in the prefill pool's queues.
    decode_kv_usage: float | None = None
    prefill_queue_depth: float | None = None
    # The share of requests with a TTFT (TPOT) target that met it, shed ones as TTFT misses;
    # None: none had one.
    ttft_attainment: float | None = None
    tpot_attainment: float | None = None


def predict(history: list[Load]) -> Load:
    """The next interval: the last load with its rate moved on by the recent trend (the mean
    change over the last up-to-3 intervals), never below 0."""
    if not history:
        raise ValueError("predict needs at least one load sample")
    last = history[-1]
    recent = history[-4:]
    slope = (recent[-1].rate - recent[0].rate) / (len(recent) - 1) if len(recent) > 1 else 0.0
    return Load(
        last.time_s,
        max(0.0, last.rate + slope),
        last.mean_prompt_tokens,
        last.mean_output_tokens,
        last.mean_ttft_s,
        last.mean_tpot_s,
    )


def correction(observed_s: float | None, expected_s: float) -> float:
    if observed_s is None or expected_s <= 0:
        return 1.0
    return min(MAX_CORRECTION, max(MIN_CORRECTION, observed_s / expected_s))


def prefill_tokens_per_s(profile: Profile, mean_prompt_tokens: float) -> float:
    """One worker's prefill throughput at a full step of prompts of that mean length."""
    budget = profile.max_num_batched_tokens
    chunk = max(1.0, min(mean_prompt_tokens, budget))
    step_s = profile.step_s(StepShape(budget, budget * chunk / 1e3))
    return budget / step_s if step_s > 0 else math.inf


def decode_step_s(profile: Profile, batch: int, context_tokens: float) -> float:
    return profile.step_s(StepShape(0, 0.0, batch, batch * context_tokens / 1e3))


def decode_seats(profile: Profile, load: Load, slo_tpot_s: float, scale: float = 1.0) -> int:
    """The largest batch one decode worker runs within the TPOT SLO (0: not even one)."""
    context = load.mean_prompt_tokens + load.mean_output_tokens / 2
    per_request = math.ceil(
        (load.mean_prompt_tokens + load.mean_output_tokens) / profile.block_size
    )
    fits = profile.num_blocks // max(1, per_request)
    best = 0
    for batch in range(1, min(profile.max_num_seqs, fits) + 1):
        if scale * decode_step_s(profile, batch, context) > slo_tpot_s:
            break
        best = batch
    return best


@dataclass(frozen=True)
class Corrections:
    prefill: float = 1.0
    decode: float = 1.0


def expected_latencies(profile: Profile, load: Load, num_decode: int) -> tuple[float, float]:
    """What the profile predicts for the load on its own: TTFT of a mean prompt (one step,
    the router's hops) and TPOT at the decode batch the load implies on ``num_decode``."""
    prompt = load.mean_prompt_tokens
    ttft = profile.step_s(StepShape(round(prompt), prompt**2 / 1e3)) + profile.router_overhead_s
    context = load.mean_prompt_tokens + load.mean_output_tokens / 2
    step = decode_step_s(profile, 1, context)
    batch = max(1, round(load.rate * load.mean_output_tokens * step / max(1, num_decode)))
    return ttft, decode_step_s(profile, batch, context)


def corrections_for(profile: Profile, load: Load, num_decode: int) -> Corrections:
    ttft, tpot = expected_latencies(profile, load, num_decode)
    return Corrections(correction(load.mean_ttft_s, ttft), correction(load.mean_tpot_s, tpot))


def desired_replicas(
    profile: Profile, load: Load, policy: ScalingPolicy, corrections: Corrections
) -> dict[Role, int]:
    """Pool sizes for ``load``, before bounds."""
    if load.rate <= 0:
        return {Role.PREFILL: 0, Role.DECODE: 0}
    tokens_per_s = prefill_tokens_per_s(profile, load.mean_prompt_tokens) / corrections.prefill
    prefill = math.ceil(load.rate * load.mean_prompt_tokens / (tokens_per_s * policy.utilization))
    seats = decode_seats(profile, load, policy.slo_tpot_s, corrections.decode)
    if seats == 0:
        decode = policy.decode.max_replicas  # the SLO is out of reach: as many as allowed
    else:
        context = load.mean_prompt_tokens + load.mean_output_tokens / 2
        step = corrections.decode * decode_step_s(profile, seats, context)
        busy_seats = load.rate * load.mean_output_tokens * step
        decode = math.ceil(busy_seats / (seats * policy.utilization))
    return {Role.PREFILL: prefill, Role.DECODE: decode}


class Signal(enum.Enum):
    """What set a pool's wanted size."""

    LOAD = "load"  # the predicted request rate, through the profile
    KV_PRESSURE = "kv_pressure"  # the decode pool's KV usage over kv_target
    QUEUE = "queued_prompt_tokens"  # prompts queued on prefill beyond what the SLO drains
    TTFT_SLO = "ttft_slo_misses"  # requests' TTFT targets missed (or shed) past slo_attainment
    TPOT_SLO = "tpot_slo_misses"  # requests' TPOT targets missed past slo_attainment


def pressure_replicas(
    profile: Profile,
    load: Load,
    policy: ScalingPolicy,
    corrections: Corrections,
    current: dict[Role, int],
) -> dict[Role, tuple[int, Signal]]:
    """The sizes the pools' own state asks for (only the pools a source reported), each with
    the signal that asked: the larger of its pressure and its SLO attainment."""
    wanted: dict[Role, tuple[int, Signal]] = {}
    if load.decode_kv_usage is not None and current[Role.DECODE] > 0:
        needed = current[Role.DECODE] * load.decode_kv_usage / policy.kv_target
        wanted[Role.DECODE] = (math.ceil(round(needed, 9)), Signal.KV_PRESSURE)
    if load.prefill_queue_depth and load.mean_prompt_tokens > 0:
        per_worker = prefill_tokens_per_s(profile, load.mean_prompt_tokens) / corrections.prefill
        queued_tokens = load.prefill_queue_depth * load.mean_prompt_tokens
        needed = math.ceil(round(queued_tokens / (per_worker * policy.slo_ttft_s), 9))
        wanted[Role.PREFILL] = (needed, Signal.QUEUE)
    for pool, share, signal in (
        (Role.PREFILL, load.ttft_attainment, Signal.TTFT_SLO),
        (Role.DECODE, load.tpot_attainment, Signal.TPOT_SLO),
    ):
        missed = slo_replicas(current[pool], share, policy.slo_attainment)
        if missed is not None and missed > wanted.get(pool, (0, signal))[0]:
            wanted[pool] = (missed, signal)
    return wanted


def slo_replicas(current: int, attainment: float | None, target: float) -> int | None:
    """A pool whose requests meet their targets less often than ``target``: grown in
    proportion to the shortfall (``current x target / attainment``), by one at least and at
    most doubled per interval (what the next interval measures decides the rest). None: met,
    nothing measured, or no pool to grow (0 replicas: the load decides)."""
    if attainment is None or attainment >= target or current == 0:
        return None
    proportional = math.ceil(round(current * target / max(attainment, 1e-9), 9))
    return min(2 * current, max(current + 1, proportional))


def wanted_replicas(
    by_load: dict[Role, int], by_pressure: dict[Role, tuple[int, Signal]]
) -> dict[Role, tuple[int, Signal]]:
    """Per pool the larger of the two, with the signal that set it (the load on a tie)."""
    wanted = {}
    for pool, n in by_load.items():
        pressed, signal = by_pressure.get(pool, (0, Signal.LOAD))
        wanted[pool] = (pressed, signal) if pressed > n else (n, Signal.LOAD)
    return wanted


@dataclass(frozen=True)
class PoolState:
    replicas: int
    last_change_s: float | None = None
    num_below: int = 0  # consecutive intervals with the desired size below the current


@dataclass(frozen=True)
class Decision:
    pool: Role
    current: int
    desired: int  # what the load wants (bounded)
    target: int  # what the pool is set to now
    reason: Reason
    signal: Signal = Signal.LOAD  # what set the wanted size


def decide(
    pool: Role, state: PoolState, wanted: int, now_s: float, policy: ScalingPolicy
) -> tuple[Decision, PoolState]:
    bounds = policy.bounds(pool)
    desired = bounds.clip(wanted)
    current = state.replicas
    if desired > current:
        return (
            Decision(pool, current, desired, desired, Reason.UP),
            PoolState(desired, now_s, 0),
        )
    if desired == current:
        reason = Reason.BOUNDS if desired != wanted else Reason.STEADY
        return Decision(pool, current, desired, current, reason), PoolState(
            current, state.last_change_s
        )
    below = state.num_below + 1
    if below < policy.down_after_intervals:
        return (
            Decision(pool, current, desired, current, Reason.HYSTERESIS),
            PoolState(current, state.last_change_s, below),
        )
    if state.last_change_s is not None and now_s - state.last_change_s < policy.cooldown_s:
        return (
            Decision(pool, current, desired, current, Reason.COOLDOWN),
            PoolState(current, state.last_change_s, below),
        )
    return Decision(pool, current, desired, desired, Reason.DOWN), PoolState(desired, now_s, 0)
