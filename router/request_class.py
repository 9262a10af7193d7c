"""A request's class: its priority band, its service-level objectives and the bounds of its
queue in the router (docs/slo.md). The router's config names the classes; a request names its
class (or takes its API key's default), and may bring a priority and SLOs of its own, which
replace the class's.

Priority follows vLLM's rule (``--scheduling-policy priority``): a lower value is served
first; values are int32, as pdserve's wire carries them. Pure data, validated on construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import InvalidField

MIN_PRIORITY, MAX_PRIORITY = -(2**31), 2**31 - 1


def check_priority(priority: int) -> None:
    """Raises ``InvalidField`` naming ``priority`` outside int32."""
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidField(
            "priority", f"priority must be in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {priority}"
        )


@dataclass(frozen=True)
class Slo:
    """Targets a request is served within: the time to its first token, and per output token
    after it. None: no target (a request without a TTFT target is admitted by its queue's
    bound alone)."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 3600:
                raise InvalidField(name, f"{name} must be in (0, 3600] seconds, got {value}")

    def over(self, own: Slo) -> Slo:
        """``own``'s targets where it has them, else these."""
        return Slo(
            own.ttft_s if own.ttft_s is not None else self.ttft_s,
            own.tpot_s if own.tpot_s is not None else self.tpot_s,
        )


@dataclass(frozen=True)
class RequestClass:
    name: str
    priority: int = 0
    slo: Slo = field(default_factory=Slo)
    # Waiting in the router longer than this, a request is shed (429): it would wait to miss.
    queue_ttl_s: float = 60.0
    # Requests of this class waiting in the router at once: past this, the next is shed.
    max_queued: int = 4096

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"a class name is letters, digits, '-' and '_', got {self.name!r}")
        check_priority(self.priority)
        if not 0 < self.queue_ttl_s <= 86400:
            raise ValueError(f"queue_ttl_s must be in (0, 86400], got {self.queue_ttl_s}")
        if self.max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {self.max_queued}")


DEFAULT_CLASS = RequestClass("default")


@dataclass(frozen=True)
class Tag:
    """What flow control reads of one request: whose it is (its fairness key), its class, and
    its own priority and SLOs over the class's."""

    key: str
    request_class: RequestClass = DEFAULT_CLASS
    priority: int | None = None  # None: the class's
    slo: Slo = field(default_factory=Slo)  # the request's own targets, over the class's

    def __post_init__(self) -> None:
        if self.priority is not None:
            check_priority(self.priority)

    @property
    def band(self) -> int:
        """The priority it is served at."""
        return self.request_class.priority if self.priority is None else self.priority

    @property
    def targets(self) -> Slo:
        return self.request_class.slo.over(self.slo)
