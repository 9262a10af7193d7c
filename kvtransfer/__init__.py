"""KV block transfer between prefill and decode workers: one contract, pluggable backends.

See ``kvtransfer.base`` for the contract (who reads, writes and frees which block, when).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config import EngineBackend
from kvtransfer.base import (
    BlockLeases,
    KVHandle,
    KVReceiver,
    KVSender,
    KVTransferError,
    TransferErrorCode,
    TransferStats,
)

if TYPE_CHECKING:
    from engine.kv_cache import KVCache
    from engine.kv_pages import KVPages
    from pdserve.common.tls import TlsConfig

BACKENDS = ("grpc", "local", "ray", "nixl")
# The backends that cross processes: what the command line offers (local is in-process only).
NETWORK_BACKENDS = tuple(b for b in BACKENDS if b != "local")
# The backends that move any engine's pages (``engine.kv_pages``). Ray and NIXL need the native
# engine's one-tensor cache: NIXL registers it whole, Ray ships it as int32 words.
PAGED_BACKENDS = ("grpc", "local")


def make_sender(
    backend: str,
    cache: KVPages,
    leases: BlockLeases,
    host: str,
    port: int,
    advertise_host: str | None = None,
    tls: TlsConfig | None = None,
    max_pull_s: float = 60.0,
    verify: bool = True,
    ucx_tls: str | None = None,
) -> KVSender:
    """``host``/``port``: where a network backend listens; ``advertise_host``: the host its
    handles name for peers (default ``host``; set it when binding 0.0.0.0); ``tls``: mutual
    TLS for a gRPC port; ``max_pull_s``: the longest one pull may hold its checkout;
    ``verify``: nixl records a digest of each handle's blocks as it issues the handle (else
    only when a receiver asks); ``ucx_tls``: nixl's UCX transports (None: UCX's choice)."""
    if backend == "grpc":
        from kvtransfer.grpc_stream import GrpcKVSender

        return GrpcKVSender(
            cache,
            leases,
            host,
            port,
            advertise_host=advertise_host,
            tls=tls,
            max_pull_s=max_pull_s,
        )
    if backend == "local":
        from kvtransfer.local import LocalKVSender

        return LocalKVSender(cache, leases)
    if backend == "ray":
        from kvtransfer.ray_object_store import RayKVSender

        return RayKVSender(_native_cache(backend, cache), leases)
    if backend == "nixl":
        from kvtransfer.nixl_sender import NixlKVSender

        return NixlKVSender(
            _native_cache(backend, cache),
            leases,
            host,
            port,
            advertise_host=advertise_host,
            tls=tls,
            max_pull_s=max_pull_s,
            verify=verify,
            ucx_tls=ucx_tls,
        )
    raise ValueError(f"kv_backend must be one of {BACKENDS}, got {backend!r}")


def require_backend(backend: str) -> None:
    """Raises ``ImportError`` with the install command when ``backend``'s optional library
    is missing: a worker calls it before loading its model, not after."""
    if backend == "nixl":
        from kvtransfer.nixl_agent import load_nixl

        load_nixl()


def make_receiver(
    backend: str,
    cache: KVPages,
    timeout_s: float,
    tls: TlsConfig | None = None,
    verify: bool = True,
    ucx_tls: str | None = None,
) -> KVReceiver:
    """``verify``: nixl checks the blocks it read against the sender's digest (grpc always
    checks its CRC32s, ray its xxh3 digests)."""
    if backend == "grpc":
        from kvtransfer.grpc_stream import GrpcKVReceiver

        return GrpcKVReceiver(cache, timeout_s, tls=tls)
    if backend == "local":
        from kvtransfer.local import LocalKVReceiver

        return LocalKVReceiver(cache)
    if backend == "ray":
        from kvtransfer.ray_object_store import RayKVReceiver

        return RayKVReceiver(_native_cache(backend, cache), timeout_s)
    if backend == "nixl":
        from kvtransfer.nixl_receiver import NixlKVReceiver

        return NixlKVReceiver(
            _native_cache(backend, cache), timeout_s, tls=tls, verify=verify, ucx_tls=ucx_tls
        )
    raise ValueError(f"kv_backend must be one of {BACKENDS}, got {backend!r}")


def check_engine(backend: str, engine: EngineBackend) -> None:
    """Refuses, by name, a backend that cannot move this engine's pages (a config check)."""
    if engine is not EngineBackend.NATIVE and backend not in PAGED_BACKENDS:
        raise ValueError(
            f"kv_backend {backend!r} needs the native engine's KV cache; the {engine.value} "
            f"engine's KV moves with {' or '.join(PAGED_BACKENDS)}"
        )


def _native_cache(backend: str, cache: KVPages) -> KVCache:
    from engine.kv_cache import KVCache

    if not isinstance(cache, KVCache):
        raise ValueError(
            f"kv_backend {backend!r} needs the native engine's KV cache; this engine's KV moves "
            f"with {' or '.join(PAGED_BACKENDS)}"
        )
    return cache


__all__ = [
    "BACKENDS",
    "NETWORK_BACKENDS",
    "PAGED_BACKENDS",
    "BlockLeases",
    "KVHandle",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "TransferErrorCode",
    "TransferStats",
    "check_engine",
    "make_receiver",
    "make_sender",
    "require_backend",
]
