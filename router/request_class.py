"""A request's class: its priority band, its service-level objectives and the bounds of its
queue in the router (docs/slo.md). The router's config names the classes; a request names its
class (or takes its API key's default), and may bring a priority and SLOs of its own, which
replace the class's.

Priority follows vLLM's rule (``--scheduling-policy priority``): a lower value is served
first; values are int32, as pdserve's wire carries them. Pure data, validated on construction.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import InvalidField, check_priority


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
    # The default is the router's prefill timeout: a class without targets waits as long as
    # a prefill may take.
    queue_ttl_s: float = 600.0
    # Requests of this class waiting in the router at once: past this, the next is shed.
    max_queued: int = 4096
    # The share of the router's release bounds (prompt tokens in flight, requests running)
    # this class's requests may fill: the rest stays free for other classes, so a request of
    # a more urgent one finds room at once instead of waiting for this class's work to end
    # (a reservation, as SGLang's gateway keeps slots per priority; 1: no reservation).
    load_share: float = 1.0

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"a class name is letters, digits, '-' and '_', got {self.name!r}")
        check_priority(self.priority)
        if not 0 < self.queue_ttl_s <= 86400:
            raise ValueError(f"queue_ttl_s must be in (0, 86400], got {self.queue_ttl_s}")
        if self.max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {self.max_queued}")
        if not 0 < self.load_share <= 1:
            raise ValueError(f"load_share must be in (0, 1], got {self.load_share}")


DEFAULT_CLASS = RequestClass("default")


@dataclass(frozen=True)
class Tenant:
    """Whose a request is, as its frontend read it: its caller (who strikes count against:
    ``key:<API key identity>`` or ``host:<client host>``), its fairness key (the caller, or
    ``header:<value>`` of the operator's fairness header) and what its API key's line names
    (``class=``, ``weight=``: docs/slo.md)."""

    caller: str
    key: str
    default_class: str | None = None
    weight: float | None = None


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


_CLASS_FIELDS = {"priority": int, "ttft_s": float, "tpot_s": float}
_CLASS_FIELDS |= {"queue_ttl_s": float, "max_queued": int, "load_share": float}


def parse_classes(spec: str) -> tuple[RequestClass, ...]:
    """The classes a ``--request-classes`` value names: ``;``-separated, each ``NAME`` or
    ``NAME:field=value,...`` with the fields ``priority``, ``ttft_s``, ``tpot_s``,
    ``queue_ttl_s``, ``max_queued``, ``load_share``; e.g.
    ``interactive:priority=-1,ttft_s=1;batch:priority=10,load_share=0.5``.
    ``default`` is always a class (its defaults, unless the spec names it). Raises ValueError
    naming the part."""
    found: dict[str, RequestClass] = {}
    for part in (p.strip() for p in spec.split(";")):
        if not part:
            continue
        name, _, body = part.partition(":")
        values: dict[str, Any] = {}
        for item in (i.strip() for i in body.split(",") if i.strip()):
            field_name, sep, raw = item.partition("=")
            kind = _CLASS_FIELDS.get(field_name.strip())
            if not sep or kind is None:
                raise ValueError(
                    f"request class {name!r}: {item!r} is not one of "
                    f"{', '.join(f + '=...' for f in _CLASS_FIELDS)}"
                )
            try:
                values[field_name.strip()] = kind(raw.strip())
            except ValueError:
                raise ValueError(
                    f"request class {name!r}: {field_name} must be {kind.__name__}, got {raw!r}"
                ) from None
        name = name.strip()
        if name in found:
            raise ValueError(f"request class {name!r} is named twice")
        slo = Slo(values.pop("ttft_s", None), values.pop("tpot_s", None))
        found[name] = dataclasses.replace(RequestClass(name), slo=slo, **values)
    found.setdefault(DEFAULT_CLASS.name, DEFAULT_CLASS)
    return tuple(found.values())
