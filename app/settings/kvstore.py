"""The flags of ``pdserve kvstore`` (docs/kv-cache.md, "The store"), read back as its config.
Part of ``app.settings``."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from app.settings.config_flags import add_field_flags, field_values
from app.settings.flags import (
    add_flag,
    add_server_flags,
    field_default,
    redis_config,
    server_config,
)
from app.settings.layout_flags import add_layout_flags, layout_of
from kvstore_service.config import KVStoreConfig
from kvtransfer import NETWORK_BACKENDS

KVSTORE_FIELDS = ("capacity_gib", "lease_s", "max_pull_s")


def add_kvstore_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    add_server_flags(parser, 50081, env)
    add_flag(parser, "--model", env, required=True, help="model directory (config: the layout)")
    add_layout_flags(parser, env)  # the workers': their blocks are what it holds
    add_field_flags(parser, env, KVStoreConfig, KVSTORE_FIELDS)
    add_flag(
        parser,
        "--kv-backend",
        env,
        default=field_default(KVStoreConfig, "kv_backend"),
        choices=NETWORK_BACKENDS,
        help="KV transfer: how pullers read its blocks (the workers')",
    )
    add_flag(
        parser, "--kv-port", env, type=int, default=50091, help="KV sender port (0: ephemeral)"
    )
    add_flag(
        parser, "--worker-id", env, default=None, help="registry id (default: kvstore-<8 hex>)"
    )


def kvstore_config(args: argparse.Namespace) -> KVStoreConfig:
    return KVStoreConfig(
        model=args.model,
        layout=layout_of(args),
        server=server_config(args),
        redis=redis_config(args),
        worker_id=args.worker_id,
        kv_backend=args.kv_backend,
        kv_port=args.kv_port,
        **field_values(args, KVStoreConfig, KVSTORE_FIELDS),
    )
