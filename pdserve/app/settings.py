"""Flags, and the typed configs they become: the only reader of argv and the environment.

Every flag can also be set by an environment variable named ``PDSERVE_<FLAG>`` (``--lease-s`` ->
``PDSERVE_LEASE_S``): what containers and Helm use. ``service_config`` turns a component's flags
into one frozen ``RouterConfig | PrefillConfig | DecodeConfig``; from there on every process is
handed typed configs (``dataclasses.replace`` per worker), never argv, except where a real OS
process starts (``pdserve up`` children, Helm's environment).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any, NoReturn

from decode_service.config import DecodeConfig
from engine.config import (
    DEFAULT_MAX_BUFFERED_TOKENS,
    AttentionBackend,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
)
from engine.model_config import DTYPE_NAMES
from kvtransfer import NETWORK_BACKENDS
from pdserve.cluster.config import RedisConfig
from pdserve.common.server import ServerConfig
from pdserve.common.tls import DEFAULT_SERVER_NAME, TlsConfig
from prefill_service.config import DEFAULT_LEASE_S, PrefillConfig
from router.config import RouterConfig
from router.limits import RequestLimits
from router.policy import DECODE_POLICIES, RoutingPolicy

ServiceConfig = RouterConfig | PrefillConfig | DecodeConfig
ROLES = ("prefill", "decode", "router")
_TRUE = {"1", "true", "yes", "on"}


def env_name(flag: str) -> str:
    return "PDSERVE_" + flag.lstrip("-").replace("-", "_").upper()


def add_flag(
    parser: argparse.ArgumentParser,
    flag: str,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> None:
    """``parser.add_argument`` whose default comes from ``PDSERVE_<FLAG>`` in ``env`` (the
    process environment unless given) when set."""
    value = (os.environ if env is None else env).get(env_name(flag))
    help_text = kwargs.pop("help", "")
    kwargs["help"] = f"{help_text} (env {env_name(flag)})".strip()
    if kwargs.get("action") == "store_true":
        if value is not None:
            kwargs["default"] = value.strip().lower() in _TRUE
    elif value is not None:
        kwargs["default"] = value  # argparse applies `type` to string defaults
        kwargs.pop("required", None)
    parser.add_argument(flag, **kwargs)


def _csv(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


# ---- the three components --------------------------------------------------------------------
def add_service_flags(
    parser: argparse.ArgumentParser, role: str, env: Mapping[str, str] | None = None
) -> None:
    """The flags of ``pdserve prefill|decode|router``."""
    adders = {"prefill": _add_prefill_flags, "decode": _add_decode_flags, "router": _add_router}
    adders[role](parser, env)


def service_config(role: str, args: argparse.Namespace) -> ServiceConfig:
    """One component's flags as its frozen config (validated on construction)."""
    if role == "router":
        return router_config(args)
    if role == "prefill":
        return PrefillConfig(
            engine=engine_config(args),
            server=server_config(args),
            lease_s=args.lease_s,
            kv_backend=args.kv_backend,
            kv_port=args.kv_port,
            max_pull_s=args.max_pull_s,
            ray_address=args.ray_address,
            redis=redis_config(args),
            worker_id=args.worker_id,
        )
    if role == "decode":
        return DecodeConfig(
            engine=engine_config(args),
            server=server_config(args),
            kv_backend=args.kv_backend,
            ray_address=args.ray_address,
            prefill_peers=args.prefill_peers,
            transfer_timeout_s=args.transfer_timeout_s,
            max_buffered_tokens=args.max_buffered_tokens,
            heartbeat_s=args.heartbeat_s,
            redis=redis_config(args),
            worker_id=args.worker_id,
        )
    raise ValueError(f"not a service role: {role!r}")


class _RaisingParser(argparse.ArgumentParser):
    """Reports bad flags as ValueError instead of exiting the process."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(f"{self.prog} flags: {message}")


def parse_service_flags(role: str, argv: list[str]) -> ServiceConfig:
    """A component's config from flags alone, ignoring the environment: for configs built on
    behalf of other processes (a Ray deployment's workers), whose environment is not ours.
    Bad flags raise ValueError naming them."""
    parser = _RaisingParser(prog=role, exit_on_error=False)
    add_service_flags(parser, role, env={})
    try:
        return service_config(role, parser.parse_args(argv))
    except argparse.ArgumentError as exc:
        raise ValueError(f"{role} flags: {exc}") from None


def add_server_flags(
    parser: argparse.ArgumentParser, default_port: int, env: Mapping[str, str] | None = None
) -> None:
    add_flag(parser, "--host", env, default="127.0.0.1", help="address to bind")
    add_flag(
        parser, "--advertise-host", env, default=None, help="host peers dial (default: --host)"
    )
    add_flag(
        parser, "--redis", env, default="", help="Redis URL: registry + prefix index (optional)"
    )
    add_flag(parser, "--redis-namespace", env, default="pdserve", help="key prefix in Redis")
    add_flag(parser, "--port", env, type=int, default=default_port, help="gRPC port (0: ephemeral)")
    add_flag(parser, "--metrics-port", env, type=int, default=None, help="Prometheus /metrics port")
    add_flag(
        parser, "--drain-timeout-s", env, type=float, default=30.0, help="graceful drain bound"
    )
    add_flag(parser, "--tls-cert", env, default=None, help="TLS certificate chain (PEM)")
    add_flag(parser, "--tls-key", env, default=None, help="TLS private key (PEM)")
    add_flag(parser, "--tls-ca", env, default=None, help="CA internal peers must chain to")
    add_flag(
        parser,
        "--tls-server-name",
        env,
        default=DEFAULT_SERVER_NAME,
        help="the name internal certificates carry (checked instead of addresses)",
    )
    add_flag(
        parser,
        "--insecure",
        env,
        action="store_true",
        help="allow plaintext on a non-loopback address (trusted networks only)",
    )


def _add_engine_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    add_flag(parser, "--model", env, required=True, help="HF checkpoint directory")
    add_flag(parser, "--dtype", env, default="float32", choices=DTYPE_NAMES)
    add_flag(parser, "--max-model-len", env, type=int, default=None)
    add_flag(parser, "--block-size", env, type=int, default=16)
    add_flag(
        parser, "--num-blocks", env, type=int, default=None, help="KV blocks (default: memory)"
    )
    add_flag(parser, "--kv-cache-bytes", env, type=int, default=None)
    add_flag(parser, "--no-prefix-caching", env, action="store_true")
    add_flag(parser, "--max-num-seqs", env, type=int, default=128)
    add_flag(parser, "--max-num-batched-tokens", env, type=int, default=2048)
    add_flag(parser, "--device", env, default=None, help="cpu, cuda, cuda:1 (default: cuda if any)")
    add_flag(
        parser,
        "--attention-backend",
        env,
        default=None,
        choices=[b.value for b in AttentionBackend],
    )
    add_flag(
        parser, "--kv-backend", env, default="grpc", choices=NETWORK_BACKENDS, help="KV transfer"
    )
    add_flag(
        parser,
        "--ray-address",
        env,
        default="auto",
        help="Ray cluster for --kv-backend ray: auto or the GCS HOST:PORT (in a Ray actor: unused)",
    )
    add_flag(parser, "--worker-id", env, default=None, help="registry id (default: <role>-<8 hex>)")


def redis_config(args: argparse.Namespace) -> RedisConfig | None:
    return RedisConfig(url=args.redis, namespace=args.redis_namespace) if args.redis else None


def tls_config(args: argparse.Namespace) -> TlsConfig | None:
    given = [args.tls_cert, args.tls_key, args.tls_ca]
    if not any(given):
        return None
    if not all(given):
        raise ValueError("TLS needs --tls-cert, --tls-key and --tls-ca together")
    return TlsConfig(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        advertise_host=args.advertise_host,
        port=args.port,
        metrics_port=args.metrics_port,
        drain_timeout_s=args.drain_timeout_s,
        tls=tls_config(args),
        insecure=args.insecure,
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    backend = args.attention_backend
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        device=args.device,
        cache=CacheConfig(
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            kv_cache_bytes=args.kv_cache_bytes,
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
        ),
        attention_backend=AttentionBackend(backend) if backend else None,
    )


def _add_prefill_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    add_server_flags(parser, 50061, env)
    _add_engine_flags(parser, env)
    add_flag(parser, "--lease-s", env, type=float, default=DEFAULT_LEASE_S, help="KV lease length")
    add_flag(
        parser, "--kv-port", env, type=int, default=50071, help="KV sender port (0: ephemeral)"
    )
    add_flag(
        parser, "--max-pull-s", env, type=float, default=60.0, help="longest one KV pull may take"
    )


def _add_decode_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    add_server_flags(parser, 50062, env)
    _add_engine_flags(parser, env)
    add_flag(parser, "--transfer-timeout-s", env, type=float, default=60.0)
    add_flag(
        parser,
        "--prefill-peers",
        env,
        type=_csv,
        default=(),
        help="prefill workers (h:p,...) to pull KV from, besides the registry's",
    )
    add_flag(
        parser,
        "--max-buffered-tokens",
        env,
        type=int,
        default=DEFAULT_MAX_BUFFERED_TOKENS,
        help="output tokens a request may have unread before it is paused",
    )
    add_flag(
        parser,
        "--heartbeat-s",
        env,
        type=float,
        default=1.0,
        help="a quiet stream sends an empty message this often (router stall detection)",
    )


def _add_router(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    add_server_flags(parser, 50051, env)
    add_flag(parser, "--model", env, required=True, help="model directory (tokenizer, config)")
    add_flag(parser, "--prefill", env, type=_csv, default=(), help="static prefill workers h:p,...")
    add_flag(parser, "--decode", env, type=_csv, default=(), help="static decode workers h:p,...")
    add_flag(
        parser, "--dtype", env, default="float32", choices=DTYPE_NAMES, help="the workers' dtype"
    )
    add_flag(parser, "--block-size", env, type=int, default=16, help="the workers' block size")
    add_flag(
        parser,
        "--prefill-policy",
        env,
        default=RoutingPolicy.CACHE_AWARE.value,
        choices=[p.value for p in RoutingPolicy],
        help="prefill worker choice",
    )
    add_flag(
        parser,
        "--decode-policy",
        env,
        default=RoutingPolicy.LEAST_LOADED.value,
        choices=[p.value for p in DECODE_POLICIES],
        help="decode worker choice",
    )
    add_flag(parser, "--cache-alpha", env, type=float, default=1.0, help="cache_aware load weight")
    add_flag(parser, "--imbalance-tokens", env, type=int, default=8192, help="cache_aware guard")
    add_flag(
        parser,
        "--local-prefill-tokens",
        env,
        type=int,
        default=32,
        help="prefill on the decode worker when fewer prompt tokens are uncached (0: never)",
    )
    add_flag(parser, "--admission-timeout-s", env, type=float, default=10.0)
    add_flag(
        parser,
        "--colocated",
        env,
        action="store_true",
        help="no prefill pool: decode workers prefill every request themselves (baseline)",
    )
    add_flag(parser, "--ready-timeout-s", env, type=float, default=120.0)
    add_flag(parser, "--api-key-file", env, default=None, help="API keys, one per line (re-read)")
    for name in RequestLimits.__dataclass_fields__:
        add_flag(
            parser,
            "--" + name.replace("_", "-"),
            env,
            type=int,
            default=getattr(RequestLimits, name),
            help=f"public request limit (default {getattr(RequestLimits, name)})",
        )
    add_flag(
        parser,
        "--migration-limit",
        env,
        type=int,
        default=3,
        help="times a broken stream is re-issued to another worker (0: never)",
    )
    add_flag(
        parser,
        "--stall-timeout-s",
        env,
        type=float,
        default=30.0,
        help="a worker stream silent this long (workers send heartbeats) counts as stalled",
    )
    add_flag(
        parser,
        "--client-idle-timeout-s",
        env,
        type=float,
        default=60.0,
        help="a client that reads nothing this long is cancelled",
    )


def router_config(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        model=args.model,
        prefill_addresses=args.prefill,
        decode_addresses=args.decode,
        server=server_config(args),
        redis=redis_config(args),
        dtype=args.dtype,
        block_size=args.block_size,
        prefill_policy=RoutingPolicy(args.prefill_policy),
        decode_policy=RoutingPolicy(args.decode_policy),
        cache_alpha=args.cache_alpha,
        imbalance_tokens=args.imbalance_tokens,
        local_prefill_tokens=args.local_prefill_tokens,
        admission_timeout_s=args.admission_timeout_s,
        ready_timeout_s=args.ready_timeout_s,
        colocated=args.colocated,
        migration_limit=args.migration_limit,
        stall_timeout_s=args.stall_timeout_s,
        client_idle_timeout_s=args.client_idle_timeout_s,
        api_key_file=args.api_key_file,
        limits=RequestLimits(**{n: getattr(args, n) for n in RequestLimits.__dataclass_fields__}),
    )


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    """What a client of the router's public API needs (``pdserve generate``, ``bench``)."""
    add_flag(
        parser,
        "--api-key",
        default=None,
        help="sent as authorization: Bearer <key>; prefer the env variable (flags show in ps)",
    )
    add_flag(parser, "--tls-ca", default=None, help="CA that signed the router's certificate")
    add_flag(
        parser,
        "--tls-server-name",
        default=None,
        help="the router's certificate name, when --router is not one (a port-forward)",
    )


# ---- whole clusters: `pdserve up` and `pdserve ray up` -------------------------------------
def add_cluster_flags(parser: argparse.ArgumentParser, default_transfer: str) -> None:
    """What ``pdserve up`` and ``pdserve ray up`` share: the pools, one KV layout for every
    component (the router refuses workers whose layout differs), and per-role extra flags."""
    add_flag(parser, "--model", required=True, help="model directory (readable by every worker)")
    add_flag(parser, "--prefill", type=int, default=1, help="number of prefill workers")
    add_flag(parser, "--decode", type=int, default=1, help="number of decode workers")
    add_flag(parser, "--port", type=int, default=50051, help="router port (0: ephemeral)")
    add_flag(parser, "--redis", default="", help="Redis URL (default: an embedded redis-server)")
    add_flag(parser, "--dtype", default="float32", choices=DTYPE_NAMES)
    add_flag(parser, "--block-size", type=int, default=16, help="KV block size (all components)")
    add_flag(
        parser,
        "--transfer",
        default=default_transfer,
        choices=NETWORK_BACKENDS,
        help="KV transfer backend",
    )
    add_flag(parser, "--prefill-args", default="", help="extra flags for every prefill worker")
    add_flag(parser, "--decode-args", default="", help="extra flags for every decode worker")
    add_flag(parser, "--router-args", default="", help="extra flags for the router")
    for flag in ROUTER_FAULT_FLAGS:  # the router's, passed through (it has the defaults)
        add_flag(parser, flag, default=None, help=f"the router's {flag}")


# Router flags `pdserve up` and `pdserve ray up` take themselves and pass through.
ROUTER_FAULT_FLAGS = ("--migration-limit", "--stall-timeout-s", "--client-idle-timeout-s")


def router_passthrough(args: argparse.Namespace) -> list[str]:
    """The pass-through router flags that were given, as router argv."""
    out: list[str] = []
    for flag in ROUTER_FAULT_FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            out += [flag, str(value)]
    return out
