"""Flags, and the typed configs they become: the only reader of argv and the environment.

Every flag can also be set by an environment variable named ``PDSERVE_<FLAG>`` (``--lease-s`` ->
``PDSERVE_LEASE_S``): what containers and Helm use. ``service_config`` turns a component's flags
into one frozen ``RouterConfig | PrefillConfig | DecodeConfig``; from there on every process is
handed typed configs (``dataclasses.replace`` per worker), never argv, except where a real OS
process starts (``pdserve up`` children, Helm's environment).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import NoReturn

from app.settings.clients import (
    ROUTER_FAULT_FLAGS,
    add_client_flags,
    add_cluster_flags,
    decode_passthrough,
    router_passthrough,
    tracing_passthrough,
    worker_passthrough,
)
from app.settings.flags import (
    PEER_TOKEN_ENV,
    add_flag,
    add_redis_flags,
    add_server_flags,
    add_tracing_flags,
    env_name,
    environment_peer_token,
    environment_vllm_cpu_bind,
    redis_config,
    server_config,
    tls_config,
)
from app.settings.kvstore import add_kvstore_flags, kvstore_config
from app.settings.layout_flags import add_layout_flags, layout_of
from app.settings.router import add_router_flags, router_config
from app.settings.serialized import ServiceConfig, from_json, role_of, to_json
from app.settings.workers import (
    add_decode_flags,
    add_prefill_flags,
    decode_config,
    engine_config,
    prefill_config,
)
from pdserve.common.role import Role

__all__ = [
    "PEER_TOKEN_ENV",
    "ROUTER_FAULT_FLAGS",
    "ServiceConfig",
    "add_client_flags",
    "add_cluster_flags",
    "add_flag",
    "add_layout_flags",
    "add_redis_flags",
    "add_server_flags",
    "add_service_flags",
    "add_tracing_flags",
    "decode_passthrough",
    "engine_config",
    "env_name",
    "environment_peer_token",
    "environment_vllm_cpu_bind",
    "from_json",
    "layout_of",
    "parse_service_flags",
    "redis_config",
    "role_of",
    "router_config",
    "router_passthrough",
    "server_config",
    "service_config",
    "stdin_config",
    "tls_config",
    "to_json",
    "tracing_passthrough",
    "worker_passthrough",
]


def add_service_flags(
    parser: argparse.ArgumentParser, role: Role, env: Mapping[str, str] | None = None
) -> None:
    """The flags of ``pdserve prefill|decode|router``."""
    adders = {
        Role.PREFILL: add_prefill_flags,
        Role.DECODE: add_decode_flags,
        Role.ROUTER: add_router_flags,
        Role.KVSTORE: add_kvstore_flags,
    }
    adders[role](parser, env)


def service_config(role: Role, args: argparse.Namespace) -> ServiceConfig:
    """One component's flags as its frozen config (validated on construction)."""
    if role is Role.ROUTER:
        return router_config(args)
    if role is Role.KVSTORE:
        return kvstore_config(args)
    if role is Role.PREFILL:
        return prefill_config(args)
    return decode_config(args)


class _RaisingParser(argparse.ArgumentParser):
    """Reports bad flags as ValueError instead of exiting the process."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(f"{self.prog} flags: {message}")


def parse_service_flags(
    role: Role, argv: list[str], *, with_environment: bool = False
) -> ServiceConfig:
    """A component's config from flags alone, ignoring the environment unless asked: for
    configs built on behalf of other processes (a Ray deployment's workers, whose environment
    is not ours; ``pdserve up``'s children, which inherit ours). Bad flags raise ValueError
    naming them."""
    parser = _RaisingParser(prog=role.value, exit_on_error=False)
    add_service_flags(parser, role, env=None if with_environment else {})
    try:
        return service_config(role, parser.parse_args(argv))
    except argparse.ArgumentError as exc:
        raise ValueError(f"{role.value} flags: {exc}") from None


def stdin_config(first_line: bool) -> ServiceConfig:
    """The whole config on this process's stdin as JSON (``settings/serialized.py``):
    ``first_line``, a supervisor's (``pdserve up``) one line, the rest of its pipe being the
    lifeline (``app/supervised.py``); else all of it (a file). ValueError naming what
    is wrong."""
    return from_json(sys.stdin.readline() if first_line else sys.stdin.read())
