"""How a process reaches the cluster state in Redis (validated on construction)."""

from __future__ import annotations

from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

DEFAULT_TTL_S = 3.0
DEFAULT_HEARTBEAT_S = 1.0


@dataclass(frozen=True)
class RedisConfig:
    url: str
    namespace: str = "pdserve"
    ttl_s: float = DEFAULT_TTL_S  # a silent worker leaves routing after this
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    publish_interval_s: float = 0.05  # KV event batching window
    # AUTH password kept out of the URL: no escaping, never in argv, never printed or logged
    # (PDSERVE_REDIS_PASSWORD; a password inside the URL wins).
    password: str = field(default="", repr=False)
    # Where the router and decode workers keep the workers they last read from the registry,
    # for a restart during an outage (pdserve/cluster/last_known.py); None: not kept.
    last_known_file: str | None = None

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"redis url must start with redis://, rediss:// or unix://: {self.url}"
            )
        if not 0 < self.heartbeat_s < self.ttl_s:
            raise ValueError(
                f"need 0 < heartbeat_s < ttl_s, got heartbeat_s={self.heartbeat_s}, "
                f"ttl_s={self.ttl_s}"
            )
        if self.publish_interval_s <= 0:
            raise ValueError(f"publish_interval_s must be > 0, got {self.publish_interval_s}")


def connect(url: str, timeout_s: float = 1.0, password: str = "") -> Redis:
    """A client that fails fast: no hidden retries (they would stall every request while Redis
    is down, and hide a Redis restart from the snapshot logic); callers retry on their own."""
    return Redis.from_url(
        url,
        password=password or None,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )
