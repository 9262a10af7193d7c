"""Router configuration (built by the CLI; validated on construction)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineBackend
from engine.kv_layout import KVCacheDtype
from pdserve.cluster.config import RedisConfig
from pdserve.common.server import ServerConfig
from router.limits import RequestLimits
from router.openai.tool_parsers import PARSERS
from router.policy import DECODE_POLICIES, RoutingPolicy


@dataclass(frozen=True)
class RouterConfig:
    model: str  # model directory: tokenizer, vocabulary, EOS ids, fingerprint
    prefill_addresses: tuple[str, ...] = ()  # static workers (also with Redis discovery)
    decode_addresses: tuple[str, ...] = ()
    server: ServerConfig = field(default_factory=ServerConfig)
    redis: RedisConfig | None = None  # registry discovery + prefix index
    # The workers' KV layout: discovered workers with another fingerprint are refused.
    dtype: str = "float32"
    block_size: int = 16
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO
    engine: EngineBackend = EngineBackend.NATIVE  # the workers' engine (names the fingerprint)
    prefill_policy: RoutingPolicy = RoutingPolicy.CACHE_AWARE
    # Decode placement follows free KV blocks; the decode pool's cache is used by conditional
    # disaggregation (choosing where to prefill locally), so cache_aware is not a decode policy.
    decode_policy: RoutingPolicy = RoutingPolicy.LEAST_LOADED
    cache_alpha: float = 1.0  # cache_aware: cached tokens - alpha x queued prefill tokens
    imbalance_tokens: int = 8192  # cache_aware: queue gap past which cache credit is dropped
    # Conditional disaggregation: a prompt whose part uncached on the best decode worker is
    # shorter than this is prefilled there (no transfer). 0 always disaggregates.
    local_prefill_tokens: int = 32
    # How long a prefilled request may wait for a decode worker with free blocks.
    admission_timeout_s: float = 10.0
    prefill_timeout_s: float = 600.0
    # Faults. A stream whose worker fails mid-flight is re-issued elsewhere (prompt + the
    # tokens already delivered) up to this many times; 0 disables migration.
    migration_limit: int = 3
    # A prompt that two workers went away running, before its first token, is refused for
    # this long (router/quarantine.py).
    quarantine_s: float = 600.0
    # The longest a worker's stream may stay silent (no token, no heartbeat: workers send one
    # every second while a request is quiet) before the worker counts as stalled and the
    # request migrates. Also bounds a decode admission (reserve + KV pull).
    stall_timeout_s: float = 30.0
    # A client that reads nothing for this long is cancelled and everything it held freed.
    client_idle_timeout_s: float = 60.0
    # Public API: what one request may carry (router/limits.py), and the API keys it needs
    # (a file, one key per line, re-read when it changes; None: no key needed).
    limits: RequestLimits = field(default_factory=RequestLimits)
    api_key_file: str | None = None
    # The OpenAI HTTP API (router/openai): on this port of the router's host; None: off.
    http_port: int | None = None
    # The name clients pass as `model` (and /v1/models lists); None: `model` as given.
    served_model_name: str | None = None
    # How `tool_choice: auto` calls are read back (router/openai/tool_parsers.py); None: the
    # format the chat template implies.
    tool_call_parser: str | None = None
    stats_interval_s: float = 1.0  # worker stats refresh, for load-aware choices
    # Waiting for workers at start-up (the API answers 503 meanwhile). None: no bound: a cold
    # GPU load or a Redis outage must not turn the router into a crash loop.
    ready_timeout_s: float | None = None
    # Colocated (the vLLM-style baseline): no prefill pool; every request is prefilled and
    # decoded by one decode worker's engine. Same router, same workers, for fair comparisons.
    colocated: bool = False

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
        if self.cache_alpha < 0 or self.imbalance_tokens < 0 or self.local_prefill_tokens < 0:
            raise ValueError("cache_alpha, imbalance_tokens and local_prefill_tokens must be >= 0")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if self.served_model_name is not None and not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {sorted(PARSERS)}, got {self.tool_call_parser!r}"
            )
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
