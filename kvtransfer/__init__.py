"""KV block transfer between prefill and decode workers: one contract, pluggable backends.

See ``kvtransfer.base`` for the contract (who reads, writes and frees which block, when).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config import EngineBackend
from kvtransfer.base import (
    BlockLeases,
    BlockRead,
    KVHandle,
    KVReceiver,
    KVSender,
    KVTransferError,
    TransferErrorCode,
    TransferStats,
)

if TYPE_CHECKING:
    from engine.kv_pages import DenseKVPages, KVPages
    from pdserve.common.tls import TlsConfig


@dataclass(frozen=True)
class SenderOptions:
    """What a sender may use. ``host``/``port``: where a network backend listens;
    ``advertise_host``: the host its handles name for peers (default ``host``; set it when
    binding 0.0.0.0); ``tls``: mutual TLS for a gRPC port; ``max_pull_s``: the longest one pull
    may hold its checkout; ``verify``: nixl records a digest of each handle's blocks as it
    issues the handle (else only when a receiver asks); ``ucx_tls``: nixl's UCX transports
    (None: UCX's choice)."""

    host: str
    port: int
    advertise_host: str | None = None
    tls: TlsConfig | None = None
    max_pull_s: float = 60.0
    verify: bool = True
    ucx_tls: str | None = None


@dataclass(frozen=True)
class ReceiverOptions:
    """What a receiver may use. ``verify``: nixl checks the blocks it read against the
    sender's digest (grpc always checks its CRC32s, ray its xxh3 digests)."""

    timeout_s: float
    tls: TlsConfig | None = None
    verify: bool = True
    ucx_tls: str | None = None


@dataclass(frozen=True)
class Backend:
    """One transfer backend: its name (the ``--kv-backend`` value), what it can move, and its
    factories (each imports its module only when called: Ray and NIXL are optional)."""

    name: str
    sender: Callable[[KVPages, BlockLeases, SenderOptions], KVSender]
    receiver: Callable[[KVPages, ReceiverOptions], KVReceiver]
    network: bool = True  # crosses processes (local is in-process only)
    # Moves any engine's pages (``engine.kv_pages``; NIXL reads their slabs where
    # ``KVPages.spans`` says they lie); else it needs the native engine's one-tensor cache
    # (Ray ships it as int32 words).
    paged: bool = False
    require: Callable[[], None] | None = None  # raises ImportError with the install command


def _grpc_sender(cache: KVPages, leases: BlockLeases, o: SenderOptions) -> KVSender:
    from kvtransfer.grpc_stream import GrpcKVSender

    return GrpcKVSender(
        cache,
        leases,
        o.host,
        o.port,
        advertise_host=o.advertise_host,
        tls=o.tls,
        max_pull_s=o.max_pull_s,
    )


def _grpc_receiver(cache: KVPages, o: ReceiverOptions) -> KVReceiver:
    from kvtransfer.grpc_stream import GrpcKVReceiver

    return GrpcKVReceiver(cache, o.timeout_s, tls=o.tls)


def _local_sender(cache: KVPages, leases: BlockLeases, o: SenderOptions) -> KVSender:
    from kvtransfer.local import LocalKVSender

    return LocalKVSender(cache, leases)


def _local_receiver(cache: KVPages, o: ReceiverOptions) -> KVReceiver:
    from kvtransfer.local import LocalKVReceiver

    return LocalKVReceiver(cache)


def _ray_sender(cache: KVPages, leases: BlockLeases, o: SenderOptions) -> KVSender:
    from kvtransfer.ray_object_store import RayKVSender

    return RayKVSender(_dense_pages("ray", cache), leases)


def _ray_receiver(cache: KVPages, o: ReceiverOptions) -> KVReceiver:
    from kvtransfer.ray_object_store import RayKVReceiver

    return RayKVReceiver(_dense_pages("ray", cache), o.timeout_s)


def _nixl_sender(cache: KVPages, leases: BlockLeases, o: SenderOptions) -> KVSender:
    from kvtransfer.nixl_sender import NixlKVSender

    return NixlKVSender(
        cache,
        leases,
        o.host,
        o.port,
        advertise_host=o.advertise_host,
        tls=o.tls,
        max_pull_s=o.max_pull_s,
        verify=o.verify,
        ucx_tls=o.ucx_tls,
    )


def _nixl_receiver(cache: KVPages, o: ReceiverOptions) -> KVReceiver:
    from kvtransfer.nixl_receiver import NixlKVReceiver

    return NixlKVReceiver(cache, o.timeout_s, tls=o.tls, verify=o.verify, ucx_tls=o.ucx_tls)


def _nixl_require() -> None:
    from kvtransfer.nixl_agent import load_nixl

    load_nixl()


# The one registry: name -> backend. Every list of backends below is derived from it.
REGISTRY: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("grpc", _grpc_sender, _grpc_receiver, paged=True),
        Backend("local", _local_sender, _local_receiver, network=False, paged=True),
        Backend("ray", _ray_sender, _ray_receiver),
        Backend("nixl", _nixl_sender, _nixl_receiver, paged=True, require=_nixl_require),
    )
}
BACKENDS = tuple(REGISTRY)
# The backends that cross processes: what the command line offers.
NETWORK_BACKENDS = tuple(name for name, b in REGISTRY.items() if b.network)
PAGED_BACKENDS = tuple(name for name, b in REGISTRY.items() if b.paged)


def backend(name: str) -> Backend:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"kv_backend must be one of {BACKENDS}, got {name!r}") from None


def make_sender(name: str, cache: KVPages, leases: BlockLeases, options: SenderOptions) -> KVSender:
    return backend(name).sender(cache, leases, options)


def make_receiver(name: str, cache: KVPages, options: ReceiverOptions) -> KVReceiver:
    return backend(name).receiver(cache, options)


def require_backend(name: str) -> None:
    """Raises ``ImportError`` with the install command when the backend's optional library
    is missing: a worker calls it before loading its model, not after."""
    require = backend(name).require
    if require is not None:
        require()


def check_engine(backend: str, engine: EngineBackend) -> None:
    """Refuses, by name, a backend that cannot move this engine's pages (a config check)."""
    if engine is not EngineBackend.NATIVE and not REGISTRY[backend].paged:
        raise ValueError(
            f"kv_backend {backend!r} needs the native engine's KV cache; the {engine.value} "
            f"engine's KV moves with {' or '.join(PAGED_BACKENDS)}"
        )


def _dense_pages(backend: str, cache: KVPages) -> DenseKVPages:
    from engine.kv_pages import DenseKVPages

    if not isinstance(cache, DenseKVPages):
        raise ValueError(
            f"kv_backend {backend!r} needs the native engine's KV cache; this engine's KV moves "
            f"with {' or '.join(PAGED_BACKENDS)}"
        )
    return cache


__all__ = [
    "BACKENDS",
    "NETWORK_BACKENDS",
    "PAGED_BACKENDS",
    "REGISTRY",
    "Backend",
    "BlockLeases",
    "BlockRead",
    "KVHandle",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "ReceiverOptions",
    "SenderOptions",
    "TransferErrorCode",
    "TransferStats",
    "backend",
    "check_engine",
    "make_receiver",
    "make_sender",
    "require_backend",
]
