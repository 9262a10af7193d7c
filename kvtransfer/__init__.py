"""KV block transfer between prefill and decode workers: one contract, pluggable backends.

See ``kvtransfer.base`` for the contract (who reads, writes and frees which block, when).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
    from pdserve.common.tls import TlsConfig

BACKENDS = ("grpc", "local", "ray")
# The backends that cross processes: what the command line offers (local is in-process only).
NETWORK_BACKENDS = tuple(b for b in BACKENDS if b != "local")


def make_sender(
    backend: str,
    cache: KVCache,
    leases: BlockLeases,
    host: str,
    port: int,
    advertise_host: str | None = None,
    tls: TlsConfig | None = None,
    max_pull_s: float = 60.0,
) -> KVSender:
    """``host``/``port``: where a network backend listens; ``advertise_host``: the host its
    handles name for peers (default ``host``; set it when binding 0.0.0.0); ``tls``: mutual
    TLS for a gRPC port; ``max_pull_s``: the longest one pull may hold its checkout."""
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

        return RayKVSender(cache, leases)
    raise ValueError(f"kv_backend must be one of {BACKENDS}, got {backend!r}")


def make_receiver(
    backend: str, cache: KVCache, timeout_s: float, tls: TlsConfig | None = None
) -> KVReceiver:
    if backend == "grpc":
        from kvtransfer.grpc_stream import GrpcKVReceiver

        return GrpcKVReceiver(cache, timeout_s, tls=tls)
    if backend == "local":
        from kvtransfer.local import LocalKVReceiver

        return LocalKVReceiver(cache)
    if backend == "ray":
        from kvtransfer.ray_object_store import RayKVReceiver

        return RayKVReceiver(cache, timeout_s)
    raise ValueError(f"kv_backend must be one of {BACKENDS}, got {backend!r}")


__all__ = [
    "BACKENDS",
    "NETWORK_BACKENDS",
    "BlockLeases",
    "KVHandle",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "TransferErrorCode",
    "TransferStats",
    "make_receiver",
    "make_sender",
]
