"""Decode worker configuration (built by the CLI; validated on construction)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import DEFAULT_MAX_BUFFERED_TOKENS, DOC, EngineConfig
from kvtransfer import BACKENDS, check_engine
from pdserve.cluster.config import RedisConfig
from pdserve.common.server import ServerConfig


@dataclass(frozen=True)
class DecodeConfig:
    engine: EngineConfig
    server: ServerConfig = field(default_factory=ServerConfig)
    redis: RedisConfig | None = None  # registry + prefix index; None: static routing only
    worker_id: str | None = None  # default: <role>-<8 hex>
    kv_backend: str = "grpc"  # one of kvtransfer.BACKENDS
    # Prefill workers to pull from besides the registry's (control addresses, host:port).
    prefill_peers: tuple[str, ...] = ()
    ray_address: str = "auto"  # --kv-backend ray in a plain process: the cluster to join
    transfer_timeout_s: float = field(
        default=60.0, metadata={DOC: "one request's whole KV pull, at most"}
    )
    # --kv-backend nixl: check the blocks read against the sender's digest (a one-sided READ
    # carries no checksum; grpc and ray always check theirs), and UCX_TLS (None: UCX's choice).
    kv_verify: bool = True
    ucx_tls: str | None = None
    release_timeout_s: float = 5.0  # telling the prefill worker it may free the blocks
    # A paused request keeps its blocks but takes no decode seat until the reader catches up.
    max_buffered_tokens: int = field(
        default=DEFAULT_MAX_BUFFERED_TOKENS,
        metadata={DOC: "output tokens a request may have unread before it is paused"},
    )
    # So the router can tell a quiet request from a stalled worker (its stall timeout must be
    # well above this).
    heartbeat_s: float = field(
        default=1.0,
        metadata={DOC: "a quiet stream sends a heartbeat this often (router stall detection)"},
    )

    def __post_init__(self) -> None:
        if self.kv_backend not in BACKENDS:
            raise ValueError(f"kv_backend must be one of {BACKENDS}, got {self.kv_backend!r}")
        check_engine(self.kv_backend, self.engine.backend)
        if not self.transfer_timeout_s > 0:
            raise ValueError(f"transfer_timeout_s must be > 0, got {self.transfer_timeout_s}")
        if self.max_buffered_tokens < 2:
            raise ValueError(f"max_buffered_tokens must be >= 2, got {self.max_buffered_tokens}")
        if not self.heartbeat_s > 0:
            raise ValueError(f"heartbeat_s must be > 0, got {self.heartbeat_s}")
        if not self.release_timeout_s > 0:
            raise ValueError(f"release_timeout_s must be > 0, got {self.release_timeout_s}")
