"""A serving component built from its typed config: what ``pdserve prefill|decode|router``
serves, and what a Ray actor serves from the very same config."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from app.settings import ServiceConfig
from decode_service.config import DecodeConfig
from engine.config import EngineBackend, EngineConfig
from engine.serving_engine import EngineBuilder
from kvstore_service.config import KVStoreConfig
from kvtransfer import require_backend
from pdserve.common.role import Role
from pdserve.common.server import ServerConfig, Service
from prefill_service.config import PrefillConfig
from router.config import RouterConfig


@dataclass(frozen=True)
class ServiceSpec:
    role: Role
    service: Service
    server: ServerConfig
    reflect: bool = False


def build_service(config: ServiceConfig) -> ServiceSpec:
    """Dispatches on the config's type; a worker on the Ray backend joins Ray first."""
    if isinstance(config, RouterConfig):
        from router.service import RouterService

        return ServiceSpec(Role.ROUTER, RouterService(config), config.server, reflect=True)
    if isinstance(config, KVStoreConfig):
        from kvstore_service.service import KVStoreService

        require_backend(config.kv_backend)
        if config.kv_backend == "ray":
            connect_ray("auto")
        return ServiceSpec(Role.KVSTORE, KVStoreService(config), config.server)
    require_backend(config.kv_backend)  # a missing optional library: refused before the model
    build_engine = engine_builder(config.engine)
    if config.kv_backend == "ray":
        connect_ray(config.ray_address)
    if isinstance(config, PrefillConfig):
        from prefill_service.service import PrefillService

        return ServiceSpec(Role.PREFILL, PrefillService(config, build_engine), config.server)
    assert isinstance(config, DecodeConfig)
    from decode_service.service import DecodeService

    return ServiceSpec(Role.DECODE, DecodeService(config, build_engine), config.server)


def engine_builder(config: EngineConfig) -> EngineBuilder:
    """The engine a worker runs; a missing vLLM install is refused here, before any model
    loads, with the command that installs it."""
    if config.backend is EngineBackend.NATIVE:
        from native_engine.builder import build_native_engine

        return build_native_engine
    from vllm_engine import require_vllm

    require_vllm()
    from vllm_engine.builder import build_vllm_engine

    return build_vllm_engine


def connect_ray(address: str) -> None:
    """Joins a Ray cluster as a driver, unless this process already is in one (a Ray actor)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address, namespace="pdserve", logging_level=logging.WARNING)
