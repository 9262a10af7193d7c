"""Flags for the serving commands. Every flag can also be set by an environment variable named
``PDSERVE_<FLAG>`` (``--lease-s`` -> ``PDSERVE_LEASE_S``): what containers and Helm use.

Only this module and ``pdserve.cli`` read argv or the environment; they build frozen configs.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from decode_service.config import DecodeConfig
from engine.config import AttentionBackend, CacheConfig, EngineConfig, SchedulerConfig
from pdserve.cluster.config import RedisConfig
from pdserve.server import ServerConfig
from prefill_service.config import DEFAULT_LEASE_S, PrefillConfig
from router.config import RouterConfig
from router.policy import RoutingPolicy

_TRUE = {"1", "true", "yes", "on"}


def env_name(flag: str) -> str:
    return "PDSERVE_" + flag.lstrip("-").replace("-", "_").upper()


def add_flag(parser: argparse.ArgumentParser, flag: str, **kwargs: Any) -> None:
    """``parser.add_argument`` whose default comes from ``PDSERVE_<FLAG>`` when set."""
    env = os.environ.get(env_name(flag))
    help_text = kwargs.pop("help", "")
    kwargs["help"] = f"{help_text} (env {env_name(flag)})".strip()
    if kwargs.get("action") == "store_true":
        if env is not None:
            kwargs["default"] = env.strip().lower() in _TRUE
    elif env is not None:
        kwargs["default"] = env  # argparse applies `type` to string defaults
        kwargs.pop("required", None)
    parser.add_argument(flag, **kwargs)


def _csv(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


def add_server_flags(parser: argparse.ArgumentParser, default_port: int) -> None:
    add_flag(parser, "--host", default="127.0.0.1", help="address to bind")
    add_flag(parser, "--advertise-host", default=None, help="host peers dial (default: --host)")
    add_flag(parser, "--redis", default="", help="Redis URL: registry + prefix index (optional)")
    add_flag(parser, "--redis-namespace", default="pdserve", help="key prefix in Redis")
    add_flag(parser, "--port", type=int, default=default_port, help="gRPC port (0: ephemeral)")
    add_flag(parser, "--metrics-port", type=int, default=None, help="Prometheus /metrics port")
    add_flag(parser, "--drain-timeout-s", type=float, default=30.0, help="graceful drain bound")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--model", required=True, help="HF checkpoint directory")
    add_flag(parser, "--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    add_flag(parser, "--max-model-len", type=int, default=None)
    add_flag(parser, "--block-size", type=int, default=16)
    add_flag(parser, "--num-blocks", type=int, default=None, help="KV blocks (default: by memory)")
    add_flag(parser, "--kv-cache-bytes", type=int, default=None)
    add_flag(parser, "--no-prefix-caching", action="store_true")
    add_flag(parser, "--max-num-seqs", type=int, default=128)
    add_flag(parser, "--max-num-batched-tokens", type=int, default=2048)
    add_flag(parser, "--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if any)")
    add_flag(parser, "--attention-backend", default=None, choices=("torch", "triton", "cpu"))
    add_flag(
        parser, "--kv-backend", default="grpc", choices=("grpc", "ray"), help="KV transfer backend"
    )
    add_flag(
        parser,
        "--ray-address",
        default="auto",
        help="Ray cluster for --kv-backend ray: auto or the GCS HOST:PORT (in a Ray actor: unused)",
    )
    add_flag(parser, "--worker-id", default=None, help="registry id (default: <role>-<8 hex>)")


def redis_config(args: argparse.Namespace) -> RedisConfig | None:
    return RedisConfig(url=args.redis, namespace=args.redis_namespace) if args.redis else None


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        advertise_host=args.advertise_host,
        port=args.port,
        metrics_port=args.metrics_port,
        drain_timeout_s=args.drain_timeout_s,
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


def add_prefill_flags(parser: argparse.ArgumentParser) -> None:
    add_server_flags(parser, default_port=50061)
    add_engine_flags(parser)
    add_flag(parser, "--lease-s", type=float, default=DEFAULT_LEASE_S, help="KV lease length")
    add_flag(parser, "--kv-port", type=int, default=50071, help="KV sender port (0: ephemeral)")


def prefill_config(args: argparse.Namespace) -> PrefillConfig:
    return PrefillConfig(
        engine=engine_config(args),
        server=server_config(args),
        lease_s=args.lease_s,
        kv_backend=args.kv_backend,
        kv_port=args.kv_port,
        redis=redis_config(args),
        worker_id=args.worker_id,
    )


def add_decode_flags(parser: argparse.ArgumentParser) -> None:
    add_server_flags(parser, default_port=50062)
    add_engine_flags(parser)
    add_flag(parser, "--transfer-timeout-s", type=float, default=60.0)


def decode_config(args: argparse.Namespace) -> DecodeConfig:
    return DecodeConfig(
        engine=engine_config(args),
        server=server_config(args),
        kv_backend=args.kv_backend,
        transfer_timeout_s=args.transfer_timeout_s,
        redis=redis_config(args),
        worker_id=args.worker_id,
    )


def add_router_flags(parser: argparse.ArgumentParser) -> None:
    add_server_flags(parser, default_port=50051)
    add_flag(parser, "--model", required=True, help="model directory (tokenizer, config)")
    add_flag(parser, "--prefill", type=_csv, default=(), help="static prefill workers h:p,...")
    add_flag(parser, "--decode", type=_csv, default=(), help="static decode workers h:p,...")
    add_flag(parser, "--dtype", default="float32", help="the workers' dtype (KV fingerprint)")
    add_flag(parser, "--block-size", type=int, default=16, help="the workers' block size")
    add_flag(
        parser,
        "--prefill-policy",
        default="cache_aware",
        choices=[p.value for p in RoutingPolicy],
        help="prefill worker choice",
    )
    add_flag(
        parser,
        "--decode-policy",
        default="least_loaded",
        choices=("round_robin", "least_loaded"),
        help="decode worker choice",
    )
    add_flag(parser, "--cache-alpha", type=float, default=1.0, help="cache_aware load weight")
    add_flag(parser, "--imbalance-tokens", type=int, default=8192, help="cache_aware guard")
    add_flag(
        parser,
        "--local-prefill-tokens",
        type=int,
        default=32,
        help="prefill on the decode worker when fewer prompt tokens are uncached (0: never)",
    )
    add_flag(parser, "--admission-timeout-s", type=float, default=10.0)
    add_flag(
        parser,
        "--colocated",
        action="store_true",
        help="no prefill pool: decode workers prefill every request themselves (baseline)",
    )
    add_flag(parser, "--ready-timeout-s", type=float, default=120.0)


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
    )
