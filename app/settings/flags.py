"""Flag helpers and the flags every component shares (server, TLS, Redis).

Every flag can also be set by an environment variable named ``PDSERVE_<FLAG>`` (``--lease-s`` ->
``PDSERVE_LEASE_S``): what containers and Helm use. Part of ``app.settings``, the only
reader of argv and the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
from collections.abc import Mapping
from typing import Any

from pdserve.cluster.config import RedisConfig
from pdserve.common.server import ServerConfig
from pdserve.common.tls import DEFAULT_SERVER_NAME, TlsConfig
from pdserve.common.tracing import TracingConfig

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


def field_default(config: type, name: str) -> Any:
    """The default of a config dataclass's field (an Enum's value): a flag that sets the field
    takes its default from there, so it is written once."""
    spec = {f.name: f for f in dataclasses.fields(config)}[name]
    if spec.default is not dataclasses.MISSING:
        value = spec.default
    elif spec.default_factory is not dataclasses.MISSING:
        value = spec.default_factory()
    else:
        raise ValueError(f"{config.__name__}.{name} has no default")
    return value.value if isinstance(value, enum.Enum) else value


def csv(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


def add_server_flags(
    parser: argparse.ArgumentParser, default_port: int, env: Mapping[str, str] | None = None
) -> None:
    add_flag(parser, "--host", env, default=field_default(ServerConfig, "host"), help="bind to")
    add_flag(
        parser, "--advertise-host", env, default=None, help="host peers dial (default: --host)"
    )
    add_redis_flags(parser, env, "Redis URL: registry + prefix index (optional)")
    parser.set_defaults(peer_token=(os.environ if env is None else env).get(PEER_TOKEN_ENV, ""))
    add_flag(
        parser,
        "--last-known-workers",
        env,
        default=field_default(RedisConfig, "last_known_file"),
        help="file of the workers last read from Redis, used after a restart while Redis is "
        "down (router and decode workers)",
    )
    add_flag(parser, "--port", env, type=int, default=default_port, help="gRPC port (0: ephemeral)")
    add_flag(parser, "--metrics-port", env, type=int, default=None, help="Prometheus /metrics port")
    drain_s = field_default(ServerConfig, "drain_timeout_s")
    add_flag(parser, "--drain-timeout-s", env, type=float, default=drain_s, help="drain bound")
    add_flag(
        parser,
        "--keepalive-s",
        env,
        type=float,
        default=field_default(ServerConfig, "keepalive_s"),
        help="ping callers of open calls this often; a silent one is cut after twice this",
    )
    add_tracing_flags(parser, env)
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


# OpenTelemetry's own variables, read when the flags are not set (docs/observability.md).
OTEL_ENDPOINT_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
OTEL_RATIO_ENV = "OTEL_TRACES_SAMPLER_ARG"


def add_tracing_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    """``--otlp-endpoint`` and ``--trace-sample-ratio`` (every server, and ``pdserve up``,
    which hands them to each component)."""
    environ = os.environ if env is None else env
    endpoint = next((environ[name] for name in OTEL_ENDPOINT_ENVS if environ.get(name)), "")
    ratio = environ.get(OTEL_RATIO_ENV) or field_default(TracingConfig, "sample_ratio")
    add_flag(
        parser,
        "--otlp-endpoint",
        env,
        default=endpoint or field_default(TracingConfig, "endpoint"),
        help="OTLP/gRPC collector for request traces, e.g. http://localhost:4317 (unset: no "
        f"traces; else {OTEL_ENDPOINT_ENVS[0]} or {OTEL_ENDPOINT_ENVS[1]})",
    )
    add_flag(
        parser,
        "--trace-sample-ratio",
        env,
        type=float,
        default=ratio,
        help=f"share of requests the router traces (else {OTEL_RATIO_ENV})",
    )


def tracing_config(args: argparse.Namespace) -> TracingConfig:
    return TracingConfig(endpoint=args.otlp_endpoint, sample_ratio=float(args.trace_sample_ratio))


REDIS_PASSWORD_ENV = "PDSERVE_REDIS_PASSWORD"
PEER_TOKEN_ENV = "PDSERVE_PEER_TOKEN"  # a secret: never a flag (argv is public on a host)


def environment_peer_token() -> str:
    """``PDSERVE_PEER_TOKEN`` ("" when unset)."""
    return os.environ.get(PEER_TOKEN_ENV, "")


VLLM_CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # vLLM's own variable


def environment_vllm_cpu_bind() -> str | None:
    """vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` when the operator set it (then ``pdserve up``
    assigns no cores: the operator's binding stands)."""
    return os.environ.get(VLLM_CPU_BIND_ENV)


def add_redis_flags(
    parser: argparse.ArgumentParser, env: Mapping[str, str] | None, help_text: str
) -> None:
    """``--redis`` and ``--redis-namespace``. The password is not a flag (argv is readable by
    every user of the host): it comes from ``PDSERVE_REDIS_PASSWORD``, or inside the URL."""
    add_flag(parser, "--redis", env, default="", help=help_text)
    namespace = field_default(RedisConfig, "namespace")
    add_flag(parser, "--redis-namespace", env, default=namespace, help="key prefix in Redis")
    parser.set_defaults(
        redis_password=(os.environ if env is None else env).get(REDIS_PASSWORD_ENV, "")
    )


def redis_config(args: argparse.Namespace) -> RedisConfig | None:
    if not args.redis:
        return None
    return RedisConfig(
        url=args.redis,
        namespace=args.redis_namespace,
        password=args.redis_password,
        last_known_file=getattr(args, "last_known_workers", None),  # servers only
    )


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
        keepalive_s=args.keepalive_s,
        tls=tls_config(args),
        insecure=args.insecure,
        peer_token=args.peer_token,
        tracing=tracing_config(args),
    )
