"""Router configuration (built by the CLI; validated on construction)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import DOC
from engine.model_layout import DEFAULT_LAYOUT, ModelLayout
from pdserve.cluster.config import RedisConfig
from pdserve.common.server import ServerConfig
from router.flow_config import FlowConfig
from router.limits import RequestLimits
from router.policy import DECODE_POLICIES, RoutingPolicy


@dataclass(frozen=True)
class RouterConfig:
    model: str  # model directory: tokenizer, vocabulary, EOS ids, fingerprint
    prefill_addresses: tuple[str, ...] = ()  # static workers (also with Redis discovery)
    decode_addresses: tuple[str, ...] = ()
    server: ServerConfig = field(default_factory=ServerConfig)
    redis: RedisConfig | None = None  # registry discovery + prefix index
    # The workers' layout: discovered workers with another fingerprint are refused.
    layout: ModelLayout = DEFAULT_LAYOUT
    prefill_policy: RoutingPolicy = field(
        default=RoutingPolicy.CACHE_AWARE, metadata={DOC: "prefill worker choice"}
    )
    # Decode placement follows free KV blocks; the decode pool's cache is used by conditional
    # disaggregation (choosing where to prefill locally), so cache_aware is not a decode policy.
    decode_policy: RoutingPolicy = RoutingPolicy.LEAST_LOADED
    # cache_aware: cached tokens - alpha x queued prefill tokens.
    cache_alpha: float = field(default=1.0, metadata={DOC: "cache_aware load weight"})
    imbalance_tokens: int = field(
        default=8192,
        metadata={DOC: "cache_aware guard: a queue gap past which cache credit is dropped"},
    )
    # The cost policy's prices (router/prefix_pricing.py); the prefill rate is the one flow
    # control measures (router/prefill_rate.py).
    peer_pull_tokens_per_s: float = field(
        default=65536.0,
        metadata={DOC: "cost policy: prompt tokens a peer pull moves per second, until measured"},
    )
    peer_pull_overhead_s: float = field(
        default=0.01, metadata={DOC: "cost policy: a peer pull's fixed cost (its lease round trip)"}
    )
    eviction_reuse: float = field(
        default=1.0,
        metadata={
            DOC: "cost policy: the share of cached blocks evicted to make room that are "
            "needed again (each priced at its recompute; 0: evictions are free)"
        },
    )
    host_load_tokens_per_s: float = field(
        default=262144.0,
        metadata={
            DOC: "cost policy: prompt tokens a worker copies in from its host tier per second"
        },
    )
    # Conditional disaggregation: no transfer.
    local_prefill_tokens: int = field(
        default=32,
        metadata={
            DOC: "prefill on the decode worker when fewer prompt tokens are uncached (0: never)"
        },
    )
    admission_timeout_s: float = field(
        default=10.0,
        metadata={DOC: "how long a prefilled request may wait for a decode worker with room"},
    )
    prefill_timeout_s: float = 600.0
    # Faults: a re-issued stream carries the prompt and the tokens already delivered.
    migration_limit: int = field(
        default=3,
        metadata={DOC: "times a broken stream is re-issued to another worker (0: never)"},
    )
    quarantine_s: float = field(  # router/quarantine.py
        default=600.0,
        metadata={
            DOC: "a prompt two workers went away running (before its first token) is refused "
            "this long"
        },
    )
    # Workers send a heartbeat every second while a request is quiet; the stalled worker's
    # requests migrate. Also bounds a decode admission (reserve + KV pull).
    stall_timeout_s: float = field(
        default=30.0,
        metadata={DOC: "a worker stream silent this long counts as stalled"},
    )
    # Everything it held is freed.
    client_idle_timeout_s: float = field(
        default=60.0, metadata={DOC: "a client that reads nothing this long is cancelled"}
    )
    # Public API: what one request may carry (router/limits.py), and the API keys it needs
    # (a file, one key per line, re-read when it changes; None: no key needed).
    limits: RequestLimits = field(default_factory=RequestLimits)
    # Flow control (docs/slo.md): request classes, fairness, what waits in the router.
    flow: FlowConfig = field(default_factory=FlowConfig)
    api_key_file: str | None = field(
        default=None, metadata={DOC: "API keys, one per line (re-read)"}
    )
    # The OpenAI HTTP API (router/openai), on the router's host.
    http_port: int | None = field(
        default=None,
        metadata={
            DOC: "serve the OpenAI API over HTTP on this port too (0: ephemeral; unset: off)"
        },
    )
    # The name /v1/models lists.
    served_model_name: str | None = field(
        default=None,
        metadata={
            DOC: "the model name clients pass in the OpenAI API (default: the model as given)"
        },
    )
    # How `tool_choice: auto` calls are read back (router/openai/tool_parsers.py, which the
    # OpenAI app checks it against as it starts); None: the format the chat template implies.
    tool_call_parser: str | None = None
    stats_interval_s: float = 1.0  # worker stats refresh, for load-aware choices
    # The API answers 503 meanwhile. No bound by default: a cold GPU load or a Redis outage
    # must not turn the router into a crash loop.
    ready_timeout_s: float | None = field(
        default=None,
        metadata={
            DOC: "exit when no worker is ready after this long (default: wait, logging each 10 s)"
        },
    )
    # The vLLM-style baseline: same router, same workers, for fair comparisons.
    colocated: bool = field(
        default=False,
        metadata={
            DOC: "no prefill pool: decode workers prefill every request themselves (baseline)"
        },
    )

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def __post_init__(self) -> None:
        if self.ready_timeout_s is not None and self.ready_timeout_s <= 0:
            raise ValueError(f"ready_timeout_s must be > 0, got {self.ready_timeout_s}")
        if self.colocated and self.prefill_addresses:
            raise ValueError("a colocated router takes no prefill_addresses")
        needs_prefill = not self.colocated
        if self.redis is None and not (
            self.decode_addresses and (self.prefill_addresses or not needs_prefill)
        ):
            raise ValueError(
                "without redis, prefill_addresses and decode_addresses must each name a worker"
                " (decode_addresses only, when colocated)"
            )
        if self.decode_policy not in DECODE_POLICIES:
            names = [p.value for p in DECODE_POLICIES]
            raise ValueError(f"decode_policy must be one of {names}, got {self.decode_policy}")
        for name in ("peer_pull_tokens_per_s", "host_load_tokens_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.eviction_reuse <= 1:
            raise ValueError(f"eviction_reuse must be in [0, 1], got {self.eviction_reuse}")
        if not self.peer_pull_overhead_s >= 0:
            raise ValueError(f"peer_pull_overhead_s must be >= 0, got {self.peer_pull_overhead_s}")
        if self.cache_alpha < 0 or self.imbalance_tokens < 0 or self.local_prefill_tokens < 0:
            raise ValueError("cache_alpha, imbalance_tokens and local_prefill_tokens must be >= 0")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if self.served_model_name is not None and not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if self.migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0, got {self.migration_limit}")
        for name in (
            "admission_timeout_s",
            "prefill_timeout_s",
            "stats_interval_s",
            "stall_timeout_s",
            "client_idle_timeout_s",
            "quarantine_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
