"""Prefill worker configuration (built by the CLI; validated on construction)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import DOC, EngineConfig
from kvtransfer import BACKENDS, check_engine
from pdserve.cluster.config import RedisConfig
from pdserve.common.server import ServerConfig

DEFAULT_LEASE_S = 30.0


@dataclass(frozen=True)
class PrefillConfig:
    engine: EngineConfig
    server: ServerConfig = field(default_factory=ServerConfig)
    redis: RedisConfig | None = None  # registry + prefix index; None: static routing only
    worker_id: str | None = None  # default: <role>-<8 hex>
    lease_s: float = field(
        default=DEFAULT_LEASE_S,
        metadata={DOC: "how long leased blocks wait for a decode worker's pull"},
    )
    kv_backend: str = "grpc"  # one of kvtransfer.BACKENDS
    ray_address: str = "auto"  # --kv-backend ray in a plain process: the cluster to join
    # Prefill workers it may pull cached prefixes from besides the registry's (host:port).
    prefill_peers: tuple[str, ...] = ()
    # The served process's flag defaults to a fixed port (app/settings/workers.py).
    kv_port: int = field(default=0, metadata={DOC: "KV sender port (0: ephemeral)"})
    # Then its lease rules apply.
    max_pull_s: float = field(
        default=60.0, metadata={DOC: "the longest one KV pull may keep the blocks checked out"}
    )
    peer_pull_timeout_s: float = field(
        default=10.0,
        metadata={
            DOC: "a peer pull's bound on the holder's answer (the pull itself is bounded by "
            "this worker's max_pull_s); past it, the prompt is computed here"
        },
    )
    # KV stores (docs/kv-cache.md) besides the registry's: what its host tier evicts is
    # offloaded to them, and prefixes are pulled back from them as from a peer (host:port).
    kv_stores: tuple[str, ...] = ()
    kv_store_replicas: int = field(
        default=1, metadata={DOC: "KV stores each offloaded prefix is written to"}
    )
    kv_verify: bool = True  # --kv-backend nixl: record a digest with each handle
    ucx_tls: str | None = None  # --kv-backend nixl: UCX_TLS (None: UCX's own choice)

    def __post_init__(self) -> None:
        if self.kv_backend not in BACKENDS:
            raise ValueError(f"kv_backend must be one of {BACKENDS}, got {self.kv_backend!r}")
        check_engine(self.kv_backend, self.engine.backend)
        if not self.lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {self.lease_s}")
        for name in ("max_pull_s", "peer_pull_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.kv_store_replicas < 1:
            raise ValueError(f"kv_store_replicas must be >= 1, got {self.kv_store_replicas}")
        if not 0 <= self.kv_port <= 65535:
            raise ValueError(f"kv_port must be in [0, 65535], got {self.kv_port}")
