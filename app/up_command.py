"""``pdserve up``: a local cluster from one command (``app/local_cluster.py``), its
flags turned into each pool's worker flags, checked by name before anything starts."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import secrets
import shlex
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

from app import settings
from app.cpu_share import worker_threads
from app.settings import add_flag
from pdserve.common.role import Role

if TYPE_CHECKING:
    from app.local_cluster import ClusterConfig


def add_up_command(sub: Any) -> None:
    """``pdserve up`` on the CLI's subcommands."""
    up = sub.add_parser("up", help="start a local cluster; Ctrl-C drains and stops it")
    settings.add_cluster_flags(up, default_kv_backend="grpc")
    add_flag(up, "--ray-address", default="", help="Ray cluster (default: start a local Ray)")
    add_flag(
        up,
        "--max-restarts",
        type=int,
        default=5,
        help="restarts of a component that exits non-zero (delay 1 s, doubling to 30 s)",
    )
    add_flag(
        up, "--http-port", type=int, default=None, help="the router's OpenAI API port (unset: off)"
    )
    add_flag(
        up,
        "--control-port",
        type=int,
        default=None,
        help="the pools' control RPC for `pdserve autoscale --target local` (0: ephemeral; "
        "unset: off). Mutual TLS with --tls-*; else whoever reaches it can resize the pools",
    )
    add_flag(up, "--api-key-file", default=None, help="the router's API keys, one per line")
    for flag in ("--tls-cert", "--tls-key", "--tls-ca"):
        add_flag(up, flag, default=None, help="mutual TLS for every component (all three)")
    add_flag(
        up,
        "--colocated",
        action="store_true",
        help="baseline: --decode workers prefill and decode in one engine (no prefill pool)",
    )
    up.set_defaults(func=_cmd_up)


def check_model(model: str, engine: str) -> None:
    """Fail here, with the file (or the missing install) named, rather than in every child
    process."""
    if engine == "vllm":
        from engine.checkpoint import CheckpointInfo
        from vllm_engine import require_vllm

        require_vllm()
        CheckpointInfo.from_dir(model)
        return
    from engine.model_config import ModelConfig

    ModelConfig.from_dir(model)


def kvstore_warnings(config: ClusterConfig) -> list[str]:
    """What makes KV stores useless in this cluster (docs/kv-cache.md, "The store")."""
    from prefill_service.config import PrefillConfig
    from router.config import RouterConfig
    from router.policy import RoutingPolicy

    if not config.num_kvstore:
        return []
    warnings = []
    model = ["--model", config.model]
    prefill = settings.parse_service_flags(Role.PREFILL, [*model, *config.prefill_args])
    assert isinstance(prefill, PrefillConfig)
    if not prefill.engine.cache.host_cache_gib:
        warnings.append(
            "--kvstore: the prefill workers have no host tier (--host-cache-gib) to offload from"
        )
    # Its Redis comes when it starts (not in router_args): any URL reads the policy.
    redis = ("--redis", "redis://redis.invalid:6379/0")
    router = settings.parse_service_flags(Role.ROUTER, [*model, *redis, *config.router_args])
    assert isinstance(router, RouterConfig)
    if router.prefill_policy is not RoutingPolicy.COST:
        warnings.append(
            f"--kvstore: the router's --prefill-policy is {router.prefill_policy.value}; only "
            "cost plans pulls from the stores"
        )
    return warnings


def cluster_config(args: argparse.Namespace) -> ClusterConfig:
    from app.local_cluster import ClusterConfig

    # One KV layout for every component: the router refuses workers whose layout differs.
    model_layout = settings.layout_of(args)
    if args.block_size is None:
        print(
            f"pdserve up: block size {model_layout.block_size} "
            f"(the {model_layout.engine.value} engine's default)"
        )
    shared = model_layout.flags()
    tls: tuple[str, ...] = ()
    for flag in ("--tls-cert", "--tls-key", "--tls-ca"):
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value:
            tls += (flag, value)
    shared += tls  # the same certificates for every component
    shared += tuple(settings.tracing_passthrough(args))
    keys = ("--api-key-file", args.api_key_file) if args.api_key_file else ()
    transfer: tuple[str, ...] = ("--kv-backend", args.kv_backend)
    num_workers = args.decode + (0 if args.colocated else args.prefill)
    transfer += worker_threads(args.engine, num_workers, len(os.sched_getaffinity(0)))
    if args.kv_backend == "ray":
        transfer += ("--ray-address", args.ray_address)
    decode_args = (
        *shared,
        *transfer,
        *settings.decode_passthrough(args),
        *shlex.split(args.decode_args),
    )
    prefill_args = (
        *shared,
        *transfer,
        *settings.worker_passthrough(args),
        *shlex.split(args.prefill_args),
    )
    # Refused by name here (the workers would only crash-loop on them).
    settings.parse_service_flags(Role.DECODE, ["--model", args.model, *decode_args])
    if not args.colocated:
        settings.parse_service_flags(Role.PREFILL, ["--model", args.model, *prefill_args])
    kvstore_args = (*shared, *transfer[:2], *shlex.split(args.kvstore_args))
    if args.kvstore:
        settings.parse_service_flags(Role.KVSTORE, ["--model", args.model, *kvstore_args])
    return ClusterConfig(
        model=args.model,
        num_prefill=0 if args.colocated else args.prefill,
        num_decode=args.decode,
        num_kvstore=args.kvstore,
        kvstore_args=kvstore_args,
        router_port=args.port,
        router_http_port=args.http_port,
        redis_url=args.redis_url,
        prefill_args=prefill_args,
        decode_args=decode_args,
        router_args=(
            *shared,
            *keys,
            *settings.router_passthrough(args),
            *shlex.split(args.router_args),
        ),
        colocated=args.colocated,
        log_level=args.log_level,
        max_restarts=args.max_restarts,
    )


def _cmd_up(args: argparse.Namespace) -> int:
    from app.embedded_redis import EmbeddedRedis, redacted
    from app.local_cluster import LocalCluster

    check_model(args.model, args.engine)  # before anything is started
    args.redis_url = args.redis
    for warning in kvstore_warnings(cluster_config(args)):  # bad flags refused by name, too
        print(f"pdserve up: {warning}", file=sys.stderr, flush=True)
    if args.kv_backend == "ray":
        args.ray_address = _local_ray(args.ray_address)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs its own
        signal.signal(sig, lambda *_: stop.set())
    redis = None if args.redis else EmbeddedRedis().start()
    if redis is not None:
        redis.supervise(_redis_restarted)
    args.redis_url = args.redis or (redis.url if redis else "")
    # A random token on every internal call: other users of this host reach the workers'
    # loopback ports, but not past the router's API keys (pdserve/common/peer_token.py).
    token = settings.environment_peer_token() or secrets.token_hex(16)
    cluster = LocalCluster(dataclasses.replace(cluster_config(args), peer_token=token))
    control = None
    try:
        cluster.start()
        for c in cluster.components:
            print(f"  {c.name:<10} {c.address}  metrics http://{c.metrics_address}/metrics")
        if args.http_port is not None:
            print(f"  OpenAI API {cluster.http_url}/v1", flush=True)
        if args.control_port is not None:  # pdserve autoscale --target local
            from app.cluster_control import serve_control
            from pdserve.common.tls import TlsConfig

            tls = None  # the cluster's own certificates (checked together by cluster_config)
            control_token = None
            if args.tls_cert:
                tls = TlsConfig(args.tls_cert, args.tls_key, args.tls_ca)
            else:  # plaintext: a token only this user can read guards the pools' sizes
                control_token = secrets.token_hex(16)
                path = write_private(cluster.state_dir, "control-token", control_token)
                print(f"pdserve up control-token {path}", flush=True)
            control, port = serve_control(
                cluster, cluster.config.host, args.control_port, tls, control_token
            )
            print(f"pdserve up control {cluster.config.host}:{port}", flush=True)
        print(
            f"pdserve cluster ready: router {cluster.address}, redis {redacted(args.redis_url)}",
            flush=True,
        )
        stop.wait()
        print("draining ...", flush=True)
    finally:
        if control is not None:
            control.stop(grace=None)
        codes = cluster.stop()
        if redis is not None:
            redis.stop()
    print(f"stopped: {codes}")
    return 0 if all(code == 0 for code in codes.values()) else 1


def write_private(directory: str, name: str, text: str) -> str:
    """``text`` in a new file only this user can read (0600, in ``directory``); its path."""
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def _redis_restarted(code: int) -> None:
    # The workers re-register and re-publish their cached blocks on their next heartbeat.
    print(f"pdserve up: redis-server exited with {code}; restarted (empty)", file=sys.stderr)


def _local_ray(address: str) -> str:
    """The GCS address workers join: the given cluster's (refused within seconds, naming it,
    when nothing answers there), or without one a Ray of its own started here (``local``:
    never whatever ``/tmp/ray`` last named), which lives as long as this command."""
    import ray

    if address:
        from app.ray_deploy.deployment import check_reachable, resolve_address

        target = resolve_address(address)
        if target is None:
            raise ConnectionError(f"no Ray cluster found for --ray-address {address}")
        check_reachable(target)
    ray.init(address=address or "local", logging_level=logging.WARNING, include_dashboard=False)
    gcs_address: str = ray.get_runtime_context().gcs_address
    print(f"ray: {gcs_address}")
    return gcs_address
