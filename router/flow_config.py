"""The router's flow control settings (docs/slo.md): the request classes, how a request's
fairness key is read, and how much prompt work the router keeps in flight at the workers
(the rest waits in its queues, in priority and fairness order). Validated on construction."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from engine.config import DOC
from router.request_class import DEFAULT_CLASS, RequestClass

_HEADER = re.compile(r"^[a-z0-9][a-z0-9-]*$")
# Headers a fairness key may not come from: the API key's own, and HTTP's framing.
_RESERVED_HEADERS = ("authorization", "content-length", "content-type", "host")


@dataclass(frozen=True)
class FlowConfig:
    # Parsed from --request-classes (request_class.parse_classes); "default" is always one.
    classes: tuple[RequestClass, ...] = (DEFAULT_CLASS,)
    default_class: str = field(
        default=DEFAULT_CLASS.name,
        metadata={DOC: "the class of a request that names none and whose API key names none"},
    )
    fairness_header: str | None = field(
        default=None,
        metadata={
            DOC: "the request header (gRPC metadata) whose value is a request's fairness key "
            "(default: its API key, else its client's host)"
        },
    )
    quantum_tokens: int = field(
        default=512,
        metadata={DOC: "prompt tokens a fairness key may send per round robin turn"},
    )
    inflight_tokens_per_worker: int = field(
        default=16384,
        metadata={
            DOC: "prompt tokens in flight per worker that computes prompts (sent, first token "
            "not back): past this, requests wait in the router in priority and fairness order"
        },
    )
    max_running_per_decode_worker: int = field(
        default=0,
        metadata={
            DOC: "requests sent and not ended, per decode worker: past this, requests wait in "
            "the router in priority and fairness order (0: no bound; a worker's decode batch "
            "is load too)"
        },
    )
    prefill_tokens_per_s: float = field(
        default=2048.0,
        metadata={
            DOC: "prompt tokens per second per worker that admission assumes until it has "
            "measured the pool"
        },
    )

    def __post_init__(self) -> None:
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError(f"request classes must have distinct names, got {names}")
        if self.default_class not in names:
            raise ValueError(f"default_class {self.default_class!r} is not one of {names}")
        header = self.fairness_header
        if header is not None and (not _HEADER.match(header) or header in _RESERVED_HEADERS):
            raise ValueError(
                f"fairness_header must be a lower-case header name other than "
                f"{', '.join(_RESERVED_HEADERS)}, got {header!r}"
            )
        if self.quantum_tokens < 1 or self.inflight_tokens_per_worker < 1:
            raise ValueError("quantum_tokens and inflight_tokens_per_worker must be >= 1")
        if self.max_running_per_decode_worker < 0:
            raise ValueError(
                f"max_running_per_decode_worker must be >= 0, got "
                f"{self.max_running_per_decode_worker}"
            )
        if not self.prefill_tokens_per_s > 0:
            raise ValueError(f"prefill_tokens_per_s must be > 0, got {self.prefill_tokens_per_s}")

    def named(self, name: str) -> RequestClass | None:
        return next((c for c in self.classes if c.name == name), None)

    @property
    def default(self) -> RequestClass:
        found = self.named(self.default_class)
        assert found is not None  # checked on construction
        return found
