"""Router configuration (built by the CLI; validated on construction)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.server import ServerConfig


@dataclass(frozen=True)
class RouterConfig:
    model: str  # model directory: tokenizer, vocabulary, EOS ids
    prefill_addresses: tuple[str, ...]
    decode_addresses: tuple[str, ...]
    server: ServerConfig = field(default_factory=ServerConfig)
    # How long a prefilled request may wait for a decode worker with free blocks.
    admission_timeout_s: float = 10.0
    prefill_timeout_s: float = 600.0
    stats_interval_s: float = 1.0  # worker stats refresh, for load-aware choices
    ready_timeout_s: float = 120.0  # waiting for workers at start-up

    def __post_init__(self) -> None:
        if not self.prefill_addresses:
            raise ValueError("prefill_addresses must name at least one prefill worker")
        if not self.decode_addresses:
            raise ValueError("decode_addresses must name at least one decode worker")
        for name in ("admission_timeout_s", "prefill_timeout_s", "stats_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
