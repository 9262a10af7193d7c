"""The Ray deployment spec: validation, and the typed configs it hands each actor (parsed once,
by the driver, from the same flags as process mode; its environment does not leak in)."""

from __future__ import annotations

import pytest

from app.ray_deploy.spec import EMBEDDED_REDIS_URL, deployment_spec
from decode_service.config import DecodeConfig
from engine.model_layout import ModelLayout
from kvstore_service.config import KVStoreConfig
from pdserve.common.role import Role
from prefill_service.config import PrefillConfig

REDIS = "redis://127.0.0.1:6379/0"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_prefill": 0}, "num_prefill >= 1"),
        ({"num_decode": 0}, "num_decode >= 1"),
        ({"num_gpus_per_worker": -1.0}, "num_gpus_per_worker"),
        ({"kv_backend": "nccl"}, "--kv-backend: invalid choice"),
        ({"kv_backend": "local"}, "--kv-backend: invalid choice"),
        ({"router_port": 70000}, "port must be in"),
        ({"max_restarts": -1}, "max_restarts"),
        ({"drain_timeout_s": 0.0}, "drain_timeout_s"),
        ({"prefill_args": ["--lease-s", "x"]}, "prefill flags"),
        ({"decode_args": ["--bogus"]}, "decode flags: unrecognized arguments: --bogus"),
        ({"num_kvstore": -1}, "num_kvstore"),
        ({"num_kvstore": 1, "kvstore_args": ["--capacity-gib", "0"]}, "capacity_gib"),
    ],
)
def test_bad_spec_is_rejected_naming_the_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        deployment_spec(model="/m", **fields)  # type: ignore[arg-type]


def test_worker_configs_are_the_process_mode_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    # A Helm Job's own environment (its pod address) must not become the workers'.
    monkeypatch.setenv("PDSERVE_ADVERTISE_HOST", "10.9.9.9")
    monkeypatch.setenv("PDSERVE_HOST", "0.0.0.0")
    spec = deployment_spec(
        model="/m",
        num_gpus_per_worker=1,
        layout=ModelLayout(block_size=32),
        prefill_args=["--lease-s", "5"],
    )
    prefill = spec.worker_config(Role.PREFILL, REDIS)
    assert isinstance(prefill, PrefillConfig)
    assert (prefill.engine.model, prefill.engine.cache.block_size) == ("/m", 32)
    assert prefill.redis is not None and prefill.redis.url == REDIS
    assert (prefill.kv_backend, prefill.engine.device, prefill.kv_port) == ("ray", "cuda", 0)
    assert (prefill.server.port, prefill.server.host, prefill.server.advertise_host) == (
        0,
        "127.0.0.1",
        None,
    )
    assert prefill.lease_s == 5.0  # extra flags come last, so they win
    assert prefill.worker_id is None  # each worker draws its own
    decode = spec.worker_config(Role.DECODE, REDIS)
    assert isinstance(decode, DecodeConfig)
    assert (decode.kv_backend, decode.server.metrics_port) == ("ray", 0)


def test_cpu_workers_pick_their_own_device_and_router_gets_its_port() -> None:
    spec = deployment_spec(
        model="/m", kv_backend="grpc", router_port=0, router_args=["--cache-alpha", "2"]
    )
    decode = spec.worker_config(Role.DECODE, REDIS)
    assert decode.engine.device is None and decode.kv_backend == "grpc"
    router = spec.router_config(REDIS)
    assert (router.server.port, router.cache_alpha) == (0, 2.0)
    assert router.redis is not None and router.redis.url == REDIS


def test_an_embedded_redis_is_filled_in_by_the_controller() -> None:
    spec = deployment_spec(model="/m", router_args=["--redis-namespace", "blue"])
    assert spec.redis_url == "" and spec.router.redis is not None
    assert spec.router.redis.url == EMBEDDED_REDIS_URL  # a name that never resolves
    router = spec.router_config(REDIS)
    assert router.redis is not None
    assert (router.redis.url, router.redis.namespace) == (REDIS, "blue")


def test_kv_stores_get_the_deployments_layout_redis_and_backend() -> None:
    spec = deployment_spec(
        model="/m",
        redis_url=REDIS,
        num_kvstore=2,
        layout=ModelLayout.parse("bfloat16", None, "int8", "native"),
        kvstore_args=["--capacity-gib", "3"],
    )
    store = spec.worker_config(Role.KVSTORE, REDIS)
    assert isinstance(store, KVStoreConfig) and spec.num_kvstore == 2
    layout = ModelLayout.of_engine(spec.prefill.engine)  # the workers' own
    assert (store.model, store.layout, store.capacity_gib) == ("/m", layout, 3.0)
    assert store.redis is not None and store.redis.url == REDIS
    assert (store.kv_backend, store.kv_port, store.worker_id) == ("ray", 0, None)
    assert deployment_spec(model="/m").kvstore is None
