"""Prometheus metrics. One process runs one component, so each uses the default registry and
exposes ``/metrics`` on its ``--metrics-port`` (``pdserve/common/metrics_server.py``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from engine.kv_layout import KVCacheLayout
from engine.outputs import EngineStats

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

# Router: what clients experience.
TTFT_S = Histogram("pdserve_ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS_S)
TPOT_S = Histogram(
    "pdserve_tpot_seconds", "Mean time per output token after the first", buckets=_LATENCY_BUCKETS_S
)
_TOKEN_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
# The load's shape, for capacity planning (pdserve autoscale): lengths of finished requests.
PROMPT_TOKENS = Histogram(
    "pdserve_request_prompt_tokens", "Prompt tokens of finished requests", buckets=_TOKEN_BUCKETS
)
OUTPUT_TOKENS = Histogram(
    "pdserve_request_output_tokens", "Output tokens of finished requests", buckets=_TOKEN_BUCKETS
)
REQUESTS = Counter("pdserve_requests_total", "Finished requests", ["finish_reason"])
REQUEST_ERRORS = Counter("pdserve_request_errors_total", "Requests ended by an error", ["code"])
ROUTER_INFLIGHT = Gauge("pdserve_router_inflight_requests", "Requests in the router")
ROUTER_ARRIVALS = Counter("pdserve_router_arrivals", "Requests admitted by the router")
# Router: flow control (router/waiting_room.py, docs/slo.md), by request class and by
# fairness key (``key_admitted``, ``key_shed``: the first MAX_KEY_LABELS keys, the rest as
# "other").
FLOW_QUEUED = Gauge(
    "pdserve_flow_queued_requests", "Requests waiting in the router's queues", ["class"]
)
FLOW_ADMITTED = Counter("pdserve_flow_admitted_total", "Requests flow control admitted", ["class"])
FLOW_INFLIGHT_TOKENS = Gauge(
    "pdserve_flow_inflight_prompt_tokens",
    "Prompt tokens the router sent to the workers and has no first token for yet",
)
FLOW_SHED = Counter(
    "pdserve_flow_shed_total",
    "Requests flow control refused or shed (queue_full, slo_unreachable, no_worker: at once; "
    "ttl_expired: after waiting)",
    ["class", "reason"],
)
FLOW_KEY_ADMITTED = Counter(
    "pdserve_flow_key_admitted_total", "Requests flow control admitted, by fairness key", ["key"]
)
FLOW_KEY_SHED = Counter(
    "pdserve_flow_key_shed_total", "Requests flow control refused or shed, by fairness key", ["key"]
)
FLOW_WAIT_S = Histogram(
    "pdserve_flow_wait_seconds",
    "Time a request waited in the router's queues",
    ["class"],
    buckets=_LATENCY_BUCKETS_S,
)
SLO_REQUESTS = Counter(
    "pdserve_slo_requests_total",
    "Requests with a target, by whether they met it (target: ttft, tpot; result: met, missed)",
    ["class", "target", "result"],
)
TTFT_PREDICTION_ERROR = Histogram(
    "pdserve_ttft_prediction_error_ratio",
    "Admission's predicted TTFT against the measured: |predicted - measured| / measured",
    ["class"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10),
)
MAX_KEY_LABELS = 64
# A key's series, by key: the first MAX_KEY_LABELS keys get their own; the rest share "other"
# (a header-chosen key must not grow the registry without bound).
_KEY_SERIES: dict[str, tuple[Counter, Counter]] = {}


def _key_series(key: str) -> tuple[Counter, Counter]:
    found = _KEY_SERIES.get(key)
    if found is None:
        label = key if len(_KEY_SERIES) < MAX_KEY_LABELS else "other"
        found = (FLOW_KEY_ADMITTED.labels(label), FLOW_KEY_SHED.labels(label))
        if label == key:
            _KEY_SERIES[key] = found
    return found


def key_admitted(key: str) -> Counter:
    """``pdserve_flow_key_admitted_total``'s series for ``key`` (or "other")."""
    return _key_series(key)[0]


def key_shed(key: str) -> Counter:
    return _key_series(key)[1]


TOKENIZATIONS_IN_FLIGHT = Gauge(
    "pdserve_tokenizations_in_flight", "Prompts being tokenized, off the event loop"
)
TOKENIZATIONS = Counter("pdserve_tokenizations_total", "Prompts tokenized (started)")
HTTP_REQUESTS = Counter(
    "pdserve_http_requests_total", "OpenAI HTTP API responses", ["route", "status"]
)
AUTH_FAILURES = Counter(
    "pdserve_auth_failures_total", "Requests refused for a missing or wrong API key"
)
HTTP_HEAD_REFUSED = Counter(
    "pdserve_http_head_refused_total",
    "HTTP connections closed for a request head too large (431), or too slow or never sent (408)",
    ["status"],
)
HTTP_IDLE_EVICTED = Counter(
    "pdserve_http_idle_evicted_total",
    "HTTP connections closed as the oldest of more than --max-idle-connections waiting for a "
    "request head",
)
DECODE_RETRIES = Counter(
    "pdserve_decode_admission_retries_total", "Decode admissions refused for lack of KV blocks"
)
PREFILL_TOKENS = Counter(
    "pdserve_prefill_tokens_total", "Prompt tokens the prefill pool computed (not cache hits)"
)
PREFIX_HIT_TOKENS = Counter(
    "pdserve_prefix_hit_tokens_total", "Prompt tokens served from a prefix cache"
)

# Workers: engine state, refreshed after every step.
QUEUE_DEPTH = Gauge("pdserve_queue_depth", "Requests waiting in the engine scheduler")
RUNNING = Gauge("pdserve_running_requests", "Requests in the engine's running batch")
KV_BLOCKS_USED = Gauge("pdserve_kv_blocks_used", "KV blocks referenced by requests")
KV_BLOCKS_FREE = Gauge("pdserve_kv_blocks_free", "KV blocks free (cached or empty)")
LEASED_REQUESTS = Gauge("pdserve_leased_requests", "Prefilled requests awaiting a KV pull")
LEASES_EXPIRED = Counter("pdserve_leases_expired_total", "Leases freed by expiry, not by decode")
PREEMPTIONS = Counter(
    "pdserve_preemptions_total",
    "Running requests preempted for KV room (their blocks freed; recomputed when resumed)",
)
PAUSED = Gauge(
    "pdserve_paused_requests", "Requests whose reader stopped reading: blocks kept, no seat"
)
OUTPUT_BUFFERED = Gauge(
    "pdserve_output_buffered_tokens",
    "Output tokens produced but not yet taken by their stream (bounded per request by "
    "--max-buffered-tokens)",
)
PROMPT_TOKENS_COMPUTED = Gauge(
    "pdserve_prompt_tokens_computed",
    "Prompt tokens this worker ran through the model (on decode: should stay 0)",
)

# Workers: speculative decoding (decode pool; zero unless --speculative-method is set).
SPEC_PROPOSED = Counter("pdserve_spec_proposed_tokens_total", "Speculative tokens verified")
SPEC_ACCEPTED = Counter(
    "pdserve_spec_accepted_tokens_total", "Speculative tokens kept (the model agreed)"
)
SPEC_VERIFICATIONS = Counter(
    "pdserve_spec_verifications_total", "Request-steps that verified speculative tokens"
)
SPEC_ACCEPTANCE = Gauge(
    "pdserve_spec_acceptance_rate", "Accepted / proposed speculative tokens since start"
)
SPEC_TOKENS_PER_STEP = Gauge(
    "pdserve_spec_tokens_per_step",
    "Tokens a verifying request-step emits on average (1 + accepted guesses)",
)
DRAFT_PROMPT_TOKENS = Counter(
    "pdserve_draft_prompt_tokens_total", "Prompt tokens the draft model computed"
)
ENGINE_STEPS = Counter("pdserve_engine_steps_total", "Engine steps that ran the model")
ENGINE_STALLED = Gauge(
    "pdserve_engine_stalled_seconds",
    "How long the engine has had work without completing a step (0: progressing or idle)",
)

# Workers: the host-memory KV tier (--host-cache-gib).
HOST_HIT_TOKENS = Counter(
    "pdserve_host_hit_tokens_total",
    "Prompt tokens loaded from the host tier instead of recomputed (part of the prefix hits)",
)
WORKER_PREFIX_HIT_TOKENS = Counter(
    "pdserve_worker_prefix_hit_tokens_total", "Prompt tokens this worker reused, both tiers"
)
HOST_KV_BLOCKS = Gauge("pdserve_host_kv_blocks", "Blocks the host tier holds", ["state"])
HOST_COPIES = Counter(
    "pdserve_host_kv_copies_total",
    "Host-tier block copies (stored: out of the device cache, loaded: back in) and evictions",
    ["kind"],
)

# Faults (router): streams moved to another worker, and what it cost the client.
QUARANTINED = Counter(
    "pdserve_quarantined_requests_total",
    "Requests ended (outcome=ended: a second worker went away running the request, or a dead "
    "engine's last words named it) or refused (outcome=refused: the same request is "
    "quarantined) as poison",
    ["outcome"],
)
MIGRATIONS = Counter(
    "pdserve_migrations_total",
    "Requests re-issued to another worker mid-flight (reason: unavailable, stall, transfer, "
    "prefill, draining)",
    ["reason"],
)
MIGRATION_ADDED_S = Histogram(
    "pdserve_migration_added_seconds",
    "Gap a migration added to a stream: from the failure to the next token",
    buckets=_LATENCY_BUCKETS_S,
)
REQUEST_PHASE_S = Histogram(
    "pdserve_request_phase_seconds",
    "Seconds a finished request spent in each phase (router/phases.py; the phases before the "
    "first token add up to its TTFT), by the path its last attempt took (disaggregated, "
    "local, colocated; none: it reached no worker)",
    ["phase", "path"],
    buckets=_LATENCY_BUCKETS_S,
)
CLIENT_IDLE_CANCELS = Counter(
    "pdserve_client_idle_cancels_total",
    "Streams cancelled because the client read nothing for --client-idle-timeout-s",
)
HEALTHY_WORKERS = Gauge(
    "pdserve_router_healthy_workers",
    "Workers this router routes to now (answering, not draining, suspected or refused)",
    ["pool"],
)
REFUSED_WORKERS = Gauge(
    "pdserve_router_refused_workers",
    "Workers this router refuses: their model, dtype or KV layout differs from its own",
    ["pool"],
)

# Cluster state (Redis): 1 when this process reaches Redis; routing degrades to load-only at 0.
REDIS_UP = Gauge("pdserve_redis_up", "Whether Redis (registry, prefix index) is reachable")
ROUTING_DECISIONS = Counter(
    "pdserve_routing_decisions_total", "Worker choices", ["pool", "policy", "reason"]
)
PREFIX_MISSES = Counter(
    "pdserve_prefix_miss_tokens_total",
    "Prompt tokens not served from cache: 'none' (no worker had them) or 'stale' (the index "
    "said the chosen worker had them, but it had evicted them)",
    ["kind"],
)

# KV transfer, on both ends.
TRANSFER_BYTES = Counter("pdserve_kv_transfer_bytes_total", "KV bytes moved", ["direction"])
TRANSFER_S = Histogram(
    "pdserve_kv_transfer_seconds", "Duration of one request's KV pull", buckets=_LATENCY_BUCKETS_S
)
TRANSFER_FAILURES = Counter("pdserve_kv_transfer_failures_total", "Failed KV pulls", ["reason"])

# Peer pull of cached prefixes (docs/kv-cache.md): the puller's and the holder's sides.
PEER_PULL_TOKENS = Counter(
    "pdserve_kv_peer_pull_tokens_total", "Prompt tokens whose KV was pulled from a peer's cache"
)
PEER_PULL_S = Histogram(
    "pdserve_kv_peer_pull_seconds",
    "One peer pull, from the holder's lookup to the blocks cached here",
    buckets=_LATENCY_BUCKETS_S,
)
PEER_PULL_FAILURES = Counter(
    "pdserve_kv_peer_pull_failures_total",
    "Peer pulls that fell back to computing the prompt, by reason",
    ["reason"],
)
PEER_LENT_BLOCKS = Counter(
    "pdserve_kv_peer_lent_blocks_total", "Cached blocks this worker leased to a peer's pull"
)

# A worker's offloads to the KV store (pdserve/worker/store_offload.py); the store's own side is
# kvstore_service/store_metrics.py.
STORE_OFFLOADS = Counter(
    "pdserve_kv_store_offloads_total",
    "Blocks this worker's host tier evicted and offloaded to a KV store, per store copy, by "
    "result (stored, held, refused by the store; failed, dropped, no_store here)",
    ["result"],
)
STORE_REPLICAS = Gauge(
    "pdserve_kv_store_replicas",
    "KV stores each prefix this worker offloads is written to (--kv-store-replicas); 0: it "
    "offloads nothing (no host tier)",
)

KV_BYTES_PER_TOKEN = Gauge(
    "pdserve_kv_cache_bytes_per_token",
    "KV cache bytes one token takes (all layers, keys and values, scales included)",
    ["kv_cache_dtype"],
)


def observe_kv_layout(layout: KVCacheLayout) -> None:
    """Once per engine: what a token costs in this worker's cache (int8/fp8 vs the model dtype)."""
    KV_BYTES_PER_TOKEN.labels(layout.kv_cache_dtype.value).set(
        layout.block_bytes / layout.block_size
    )


class EngineObserver:
    """Publishes one engine's stats after each step (its worker service owns one): gauges are
    set, counters move by what this engine added since its last report (engines count from
    their start; a process may run several, as tests do)."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def __call__(self, stats: EngineStats, num_buffered_tokens: int = 0) -> None:
        QUEUE_DEPTH.set(stats.num_waiting)
        RUNNING.set(stats.num_running)
        PAUSED.set(stats.num_paused)
        OUTPUT_BUFFERED.set(num_buffered_tokens)
        KV_BLOCKS_USED.set(stats.num_blocks - stats.num_free_blocks)
        KV_BLOCKS_FREE.set(stats.num_free_blocks)
        PROMPT_TOKENS_COMPUTED.set(stats.num_prompt_tokens_computed)
        self._advance(ENGINE_STEPS, "steps", stats.num_steps)
        self._advance(PREEMPTIONS, "preemptions", stats.num_preemptions)
        self._advance(SPEC_PROPOSED, "proposed", stats.num_spec_proposed_tokens)
        self._advance(SPEC_ACCEPTED, "accepted", stats.num_spec_accepted_tokens)
        self._advance(SPEC_VERIFICATIONS, "verifications", stats.num_spec_verifications)
        self._advance(DRAFT_PROMPT_TOKENS, "draft_prompt", stats.num_draft_prompt_tokens_computed)
        self._advance(HOST_HIT_TOKENS, "host_hits", stats.num_host_hit_tokens)
        self._advance(WORKER_PREFIX_HIT_TOKENS, "prefix_hits", stats.num_prefix_hit_tokens)
        self._advance(HOST_COPIES.labels("stored"), "host_stored", stats.num_host_stored_blocks)
        self._advance(HOST_COPIES.labels("loaded"), "host_loaded", stats.num_host_loaded_blocks)
        self._advance(HOST_COPIES.labels("evicted"), "host_evicted", stats.num_host_evicted_blocks)
        if stats.num_host_blocks:
            HOST_KV_BLOCKS.labels("used").set(stats.num_host_cached_blocks)
            HOST_KV_BLOCKS.labels("free").set(stats.num_host_blocks - stats.num_host_cached_blocks)
        if stats.num_spec_verifications:
            SPEC_ACCEPTANCE.set(stats.num_spec_accepted_tokens / stats.num_spec_proposed_tokens)
            accepted_per_step = stats.num_spec_accepted_tokens / stats.num_spec_verifications
            SPEC_TOKENS_PER_STEP.set(1 + accepted_per_step)

    def _advance(self, counter: Counter, key: str, total: int) -> None:
        counter.inc(max(total - self._last.get(key, 0), 0))
        self._last[key] = total
