"""KV store configuration (built by the CLI; validated on construction)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.config import DOC, EngineBackend
from engine.model_layout import DEFAULT_LAYOUT, ModelLayout
from kvtransfer import BACKENDS
from pdserve.cluster.config import RedisConfig
from pdserve.common.server import ServerConfig

DEFAULT_LEASE_S = 30.0


@dataclass(frozen=True)
class KVStoreConfig:
    model: str  # the checkpoint directory: the store's KV layout and block hashes come from it
    layout: ModelLayout = DEFAULT_LAYOUT  # the cluster's (engine/model_layout.py)
    server: ServerConfig = field(default_factory=ServerConfig)
    redis: RedisConfig | None = None  # registry + prefix index; None: known by address only
    worker_id: str | None = None  # default: kvstore-<8 hex>
    capacity_gib: float = field(
        default=4.0, metadata={DOC: "host memory for KV blocks (GiB): the store's capacity"}
    )
    lease_s: float = field(
        default=DEFAULT_LEASE_S,
        metadata={DOC: "how long blocks leased to a pull wait for it"},
    )
    kv_backend: str = "grpc"  # one of kvtransfer.BACKENDS: how pullers read its blocks
    kv_port: int = field(default=0, metadata={DOC: "KV sender port (0: ephemeral)"})
    max_pull_s: float = field(
        default=60.0, metadata={DOC: "the longest one KV pull may keep the blocks checked out"}
    )

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model is required: the store's KV layout comes from it")
        if self.layout.engine is not EngineBackend.NATIVE:
            raise ValueError(
                f"engine {self.layout.engine.value!r}: a KV store holds the native engine's "
                "pages only (vLLM's KV is not lent: docs/engines.md)"
            )
        if not (math.isfinite(self.capacity_gib) and self.capacity_gib > 0):
            raise ValueError(f"capacity_gib must be finite and > 0, got {self.capacity_gib}")
        if self.kv_backend not in BACKENDS:
            raise ValueError(f"kv_backend must be one of {BACKENDS}, got {self.kv_backend!r}")
        for name in ("lease_s", "max_pull_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.kv_port <= 65535:
            raise ValueError(f"kv_port must be in [0, 65535], got {self.kv_port}")
