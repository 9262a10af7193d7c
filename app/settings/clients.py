"""The flags of the router's clients (``pdserve generate``, ``bench``) and of whole clusters
(``pdserve up``, ``pdserve ray up``). Part of ``app.settings``."""

from __future__ import annotations

import argparse

from app.settings.flags import (
    add_flag,
    add_tracing_flags,
)
from app.settings.layout_flags import add_layout_flags
from kvtransfer import NETWORK_BACKENDS


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


def add_cluster_flags(parser: argparse.ArgumentParser, default_kv_backend: str) -> None:
    """What ``pdserve up`` and ``pdserve ray up`` share: the pools, one KV layout for every
    component (the router refuses workers whose layout differs), and per-role extra flags."""
    add_flag(parser, "--model", required=True, help="model directory (readable by every worker)")
    add_flag(parser, "--prefill", type=int, default=1, help="number of prefill workers")
    add_flag(parser, "--decode", type=int, default=1, help="number of decode workers")
    add_flag(parser, "--port", type=int, default=50051, help="router port (0: ephemeral)")
    add_flag(parser, "--redis", default="", help="Redis URL (default: an embedded redis-server)")
    add_layout_flags(parser, None)  # one for every component
    add_flag(
        parser,
        "--kv-backend",
        default=default_kv_backend,
        choices=NETWORK_BACKENDS,
        help="KV transfer backend (every worker's --kv-backend)",
    )
    add_tracing_flags(parser, None)  # every component's: tracing_passthrough
    add_flag(
        parser,
        "--kvstore",
        type=int,
        default=0,
        help="KV stores: prefill workers offload what their host tier (--host-cache-gib) evicts "
        "to them and pull prefixes back (docs/kv-cache.md)",
    )
    add_flag(parser, "--kvstore-args", default="", help="extra flags for every KV store")
    add_flag(parser, "--prefill-args", default="", help="extra flags for every prefill worker")
    add_flag(parser, "--decode-args", default="", help="extra flags for every decode worker")
    add_flag(parser, "--router-args", default="", help="extra flags for the router")
    for flag in ROUTER_FAULT_FLAGS:  # the router's, passed through (it has the defaults)
        add_flag(parser, flag, default=None, help=f"the router's {flag}")
    for flag in DECODE_SPEC_FLAGS:  # every decode worker's (speculative decoding)
        add_flag(parser, flag, default=None, help=f"every decode worker's {flag}")
    for flag in WORKER_FLAGS:  # every worker's, prefill and decode
        add_flag(parser, flag, default=None, help=f"every worker's {flag}")
    for flag in WORKER_SWITCHES:
        add_flag(parser, flag, action="store_true", help=f"every worker's {flag}")


# Flags `pdserve up` and `pdserve ray up` take themselves and pass through to one role.
ROUTER_FAULT_FLAGS = ("--migration-limit", "--stall-timeout-s", "--client-idle-timeout-s")
DECODE_SPEC_FLAGS = (
    "--speculative-method",
    "--num-speculative-tokens",
    "--spec-ngram-min",
    "--spec-ngram-max",
    "--spec-draft-model",
    "--spec-max-batch-size",
    "--spec-min-acceptance",
)


WORKER_FLAGS = (
    "--host-cache-gib",
    "--max-model-len",
    "--kv-cache-bytes",
    # --engine vllm's own (docs/engines.md)
    "--tensor-parallel-size",
    "--gpu-memory-utilization",
    "--quantization",
    "--engine-core",
)
WORKER_SWITCHES = ("--enforce-eager",)


def _passthrough(args: argparse.Namespace, flags: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for flag in flags:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            out += [flag, str(value)]
    return out


def tracing_passthrough(args: argparse.Namespace) -> list[str]:
    """Every component's tracing flags: all trace to one collector, the router sampling."""
    if not args.otlp_endpoint:
        return []
    return [
        "--otlp-endpoint",
        args.otlp_endpoint,
        "--trace-sample-ratio",
        str(args.trace_sample_ratio),
    ]


def router_passthrough(args: argparse.Namespace) -> list[str]:
    """The pass-through router flags that were given, as router argv."""
    return _passthrough(args, ROUTER_FAULT_FLAGS)


def decode_passthrough(args: argparse.Namespace) -> list[str]:
    """The pass-through decode-worker flags that were given, as decode-worker argv."""
    return _passthrough(args, DECODE_SPEC_FLAGS) + worker_passthrough(args)


def worker_passthrough(args: argparse.Namespace) -> list[str]:
    """The pass-through flags of every worker (prefill and decode) that were given (the layout,
    the engine with it, is every component's: ``ModelLayout.flags``)."""
    switches = [f for f in WORKER_SWITCHES if getattr(args, f.lstrip("-").replace("-", "_"))]
    return [*_passthrough(args, WORKER_FLAGS), *switches]
