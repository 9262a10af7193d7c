"""The transfer backends' one registry (kvtransfer.REGISTRY): every list of backends derives
from it, an unknown name is refused by name, and what a backend can move is checked against
the engine before any worker starts."""

from __future__ import annotations

import pytest

from engine.config import EngineBackend
from kvtransfer import (
    BACKENDS,
    NETWORK_BACKENDS,
    PAGED_BACKENDS,
    REGISTRY,
    ReceiverOptions,
    backend,
    check_engine,
    make_receiver,
    require_backend,
)


def test_the_lists_derive_from_the_registry() -> None:
    assert BACKENDS == ("grpc", "local", "ray", "nixl") == tuple(REGISTRY)
    assert NETWORK_BACKENDS == ("grpc", "ray", "nixl")
    assert PAGED_BACKENDS == ("grpc", "local", "nixl")
    assert all(backend(name).name == name for name in BACKENDS)


def test_an_unknown_backend_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"kv_backend must be one of .*'grpc'.*got 'tcp'"):
        backend("tcp")
    with pytest.raises(ValueError, match="got 'tcp'"):
        require_backend("tcp")


@pytest.mark.parametrize("name", ["ray"])
def test_backends_of_the_native_cache_refuse_other_engines(name: str) -> None:
    check_engine(name, EngineBackend.NATIVE)
    with pytest.raises(ValueError, match=f"kv_backend '{name}' needs the native engine's KV"):
        check_engine(name, EngineBackend.VLLM)
    for paged in PAGED_BACKENDS:
        check_engine(paged, EngineBackend.VLLM)


def test_a_native_only_backend_refuses_pages_that_are_not_the_native_cache() -> None:
    with pytest.raises(ValueError, match="kv_backend 'ray' needs the native engine's KV cache"):
        make_receiver("ray", object(), ReceiverOptions(timeout_s=1.0))  # type: ignore[arg-type]
