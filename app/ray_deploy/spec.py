"""What ``pdserve ray up`` deploys: typed component configs plus placement (validated on
construction). The driver parses every flag once, here; the controller hands each actor a copy
(``dataclasses.replace``) and no argv ever travels between Python objects."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from app.settings import parse_service_flags
from decode_service.config import DecodeConfig
from engine.config import EngineBackend
from engine.model_layout import DEFAULT_LAYOUT, ModelLayout
from kvstore_service.config import KVStoreConfig
from kvtransfer import NETWORK_BACKENDS
from pdserve.cluster.config import RedisConfig
from pdserve.common.role import Role
from prefill_service.config import PrefillConfig
from router.config import RouterConfig

DEFAULT_NAMESPACE = "pdserve"
CONTROLLER_NAME = "pdserve-controller"
# Templates name this Redis until the controller knows its embedded server's address; the
# reserved .invalid domain never resolves, so a template that escaped unfilled fails loudly.
EMBEDDED_REDIS_URL = "redis://embedded.invalid:6379/0"


@dataclass(frozen=True)
class DeploymentSpec:
    prefill: PrefillConfig  # every prefill worker's config, before the controller fills Redis in
    decode: DecodeConfig
    router: RouterConfig
    kvstore: KVStoreConfig | None = None  # every KV store's config (None: no stores)
    num_prefill: int = 1
    num_decode: int = 1
    num_kvstore: int = 0
    num_gpus_per_worker: float = 0.0  # Ray places each worker on a node with this many GPUs
    num_cpus_per_worker: float = 1.0
    redis_url: str = ""  # "": an embedded redis-server in the controller (single-node only)
    max_restarts: int = 3  # per actor; a crashed worker comes back at most this often
    ready_timeout_s: float = 300.0
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("a deployment needs num_prefill >= 1 and num_decode >= 1")
        if self.num_kvstore < 0 or (self.num_kvstore and self.kvstore is None):
            raise ValueError("num_kvstore must be >= 0, and KV stores need their config")
        if self.num_gpus_per_worker < 0 or self.num_cpus_per_worker < 0:
            raise ValueError("num_gpus_per_worker and num_cpus_per_worker must be >= 0")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.ready_timeout_s <= 0 or self.drain_timeout_s <= 0:
            raise ValueError("ready_timeout_s and drain_timeout_s must be > 0")
        if self.prefill.kv_backend != self.decode.kv_backend:
            raise ValueError(
                f"prefill kv_backend {self.prefill.kv_backend!r} != decode kv_backend "
                f"{self.decode.kv_backend!r}"
            )
        if self.prefill.kv_backend not in NETWORK_BACKENDS:
            raise ValueError(
                f"kv_backend must be one of {NETWORK_BACKENDS}, got {self.prefill.kv_backend!r}"
            )

    def worker_config(
        self, role: Role, redis_url: str
    ) -> PrefillConfig | DecodeConfig | KVStoreConfig:
        """One more worker (or KV store) of ``role``: its own id is drawn when it starts."""
        template: PrefillConfig | DecodeConfig | KVStoreConfig | None = self.kvstore
        if role is not Role.KVSTORE:
            template = self.prefill if role is Role.PREFILL else self.decode
        assert template is not None, "no KV store config: num_kvstore is 0"
        return replace(template, redis=_with_url(template.redis, redis_url), worker_id=None)

    def router_config(self, redis_url: str) -> RouterConfig:
        return replace(self.router, redis=_with_url(self.router.redis, redis_url))


def _with_url(redis: RedisConfig | None, url: str) -> RedisConfig:
    return RedisConfig(url) if redis is None else replace(redis, url=url)


def deployment_spec(
    *,
    model: str,
    num_prefill: int = 1,
    num_decode: int = 1,
    num_gpus_per_worker: float = 0.0,
    num_cpus_per_worker: float = 1.0,
    kv_backend: str = "ray",
    redis_url: str = "",
    router_port: int = 50051,
    max_restarts: int = 3,
    layout: ModelLayout = DEFAULT_LAYOUT,
    drain_timeout_s: float = 30.0,
    prefill_args: Sequence[str] = (),
    decode_args: Sequence[str] = (),
    router_args: Sequence[str] = (),
    num_kvstore: int = 0,
    kvstore_args: Sequence[str] = (),
) -> DeploymentSpec:
    """Parses each role's flags (the common ones, then the extra ones, which win) into its
    config, as ``pdserve prefill|decode|router`` would, ignoring this process's environment:
    the components run elsewhere, and this driver's PDSERVE_* (say, a Helm Job's host) are
    not theirs. Two settings belong to the deployment, not to the extra flags: the Redis URL
    (the deployment's own) and the worker id (each worker draws its own); a loopback
    ``--host`` becomes the node's address (peers on other nodes must reach it)."""
    common = ["--model", model, "--redis", redis_url or EMBEDDED_REDIS_URL, *layout.flags()]
    common += ["--drain-timeout-s", str(drain_timeout_s)]
    # Actors bind their node's address in plaintext: a Ray cluster's own traffic is not
    # encrypted either, and its token auth and network isolation are what protect both
    # (docs/security.md).
    common += ["--insecure"]
    workers = [*common, "--port", "0", "--metrics-port", "0", "--kv-backend", kv_backend]
    if layout.engine is EngineBackend.NATIVE:  # vLLM finds its GPUs and binds its threads itself
        if num_gpus_per_worker > 0:
            workers += ["--device", "cuda"]  # Ray sets CUDA_VISIBLE_DEVICES to the actor's GPUs
        # The actor's CPUs, not the node's: actors share the node.
        workers += ["--num-threads", str(max(1, int(num_cpus_per_worker)))]
    prefill = parse_service_flags(Role.PREFILL, [*workers, "--kv-port", "0", *prefill_args])
    decode = parse_service_flags(Role.DECODE, [*workers, *decode_args])
    router = parse_service_flags(
        Role.ROUTER, [*common, "--port", str(router_port), "--metrics-port", "0", *router_args]
    )
    assert isinstance(prefill, PrefillConfig) and isinstance(decode, DecodeConfig)
    assert isinstance(router, RouterConfig)
    kvstore = None
    if num_kvstore:
        store = [*common, "--port", "0", "--metrics-port", "0", "--kv-backend", kv_backend]
        parsed = parse_service_flags(Role.KVSTORE, [*store, "--kv-port", "0", *kvstore_args])
        assert isinstance(parsed, KVStoreConfig)
        kvstore = parsed
    return DeploymentSpec(
        prefill=prefill,
        decode=decode,
        router=router,
        kvstore=kvstore,
        num_prefill=num_prefill,
        num_decode=num_decode,
        num_kvstore=num_kvstore,
        num_gpus_per_worker=num_gpus_per_worker,
        num_cpus_per_worker=num_cpus_per_worker,
        redis_url=redis_url,
        max_restarts=max_restarts,
        drain_timeout_s=drain_timeout_s,
    )
