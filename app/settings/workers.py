"""The flags of ``pdserve prefill`` and ``pdserve decode`` (engine, KV, leases) and their
configs. Part of ``app.settings``."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping

from app.settings.config_flags import add_field_flags, field_values
from app.settings.flags import (
    add_flag,
    add_server_flags,
    csv,
    field_default,
    redis_config,
    server_config,
)
from app.settings.layout_flags import add_layout_flags, layout_of
from decode_service.config import DecodeConfig
from engine.config import (
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmOptions,
)
from kvtransfer import NETWORK_BACKENDS
from prefill_service.config import PrefillConfig

# The fields each config's flags set (``app/settings/config_flags.py``: name, type, default
# and help come from the field); the rest are set by the flags written below.
SCHEDULER_FIELDS = tuple(f.name for f in dataclasses.fields(SchedulerConfig))
VLLM_FIELDS = tuple(f.name for f in dataclasses.fields(VllmOptions))
SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(SpeculativeConfig))
# Older spellings of speculation's flags: --speculative-method, --spec-<field>.
SPEC_FLAGS = {
    "method": "speculative_method",
    "num_speculative_tokens": "num_speculative_tokens",
    **{
        name: f"spec_{name}"
        for name in SPEC_FIELDS
        if name not in ("method", "num_speculative_tokens")
    },
}
ENGINE_FIELDS = (
    "max_model_len",
    "device",
    "attention_backend",
    "num_threads",
    "fault_exit_on_token",
    "fault_stall_at_step",
    "fault_raise_on_token",
    "liveness_stall_s",
)
CACHE_FIELDS = ("num_blocks", "kv_cache_bytes", "host_cache_gib")
PREFILL_FIELDS = ("lease_s", "max_pull_s", "peer_pull_timeout_s", "kv_store_replicas")
DECODE_FIELDS = ("transfer_timeout_s", "max_buffered_tokens", "heartbeat_s")


def add_engine_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    add_flag(parser, "--model", env, required=True, help="HF checkpoint directory")
    add_layout_flags(parser, env)
    add_vllm_flags(parser, env)
    add_flag(parser, "--no-prefix-caching", env, action="store_true")
    add_field_flags(parser, env, EngineConfig, ENGINE_FIELDS)
    add_field_flags(parser, env, CacheConfig, CACHE_FIELDS)
    add_field_flags(parser, env, SchedulerConfig, SCHEDULER_FIELDS)
    add_flag(
        parser,
        "--kv-backend",
        env,
        default=field_default(PrefillConfig, "kv_backend"),
        choices=NETWORK_BACKENDS,
        help="KV transfer",
    )
    add_flag(
        parser,
        "--ray-address",
        env,
        default=field_default(PrefillConfig, "ray_address"),
        help="Ray cluster for --kv-backend ray: auto or the GCS HOST:PORT (in a Ray actor: unused)",
    )
    add_flag(parser, "--worker-id", env, default=None, help="registry id (default: <role>-<8 hex>)")
    add_flag(
        parser,
        "--ucx-tls",
        env,
        default=None,
        help="--kv-backend nixl: UCX_TLS for this worker (default: UCX's own choice)",
    )
    add_flag(
        parser,
        "--kv-verify",
        env,
        default="on",
        choices=("on", "off"),
        help="--kv-backend nixl: prefill records a digest of each handle's blocks, decode checks"
        " what it read against it",
    )


def add_vllm_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    """The options only the vLLM engine has, under vLLM's own names (refused by name with the
    native engine)."""
    add_field_flags(parser, env, VllmOptions, VLLM_FIELDS)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    layout = layout_of(args)
    return EngineConfig(
        model=args.model,
        dtype=layout.dtype.value,
        cache=CacheConfig(
            block_size=layout.block_size,
            enable_prefix_caching=not args.no_prefix_caching,
            kv_cache_dtype=layout.kv_cache_dtype,
            **field_values(args, CacheConfig, CACHE_FIELDS),
        ),
        scheduler=SchedulerConfig(**field_values(args, SchedulerConfig, SCHEDULER_FIELDS)),
        backend=layout.engine,
        vllm=vllm_options(args),
        **field_values(args, EngineConfig, ENGINE_FIELDS),
    )


def vllm_options(args: argparse.Namespace) -> VllmOptions:
    """The flags ``add_vllm_flags`` added, as their config."""
    return VllmOptions(**field_values(args, VllmOptions, VLLM_FIELDS))


def add_prefill_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    add_server_flags(parser, 50061, env)
    add_engine_flags(parser, env)
    add_field_flags(parser, env, PrefillConfig, PREFILL_FIELDS)
    # A served worker's own fixed port (one built in code, in tests or Ray, takes any: 0).
    add_flag(
        parser, "--kv-port", env, type=int, default=50071, help="KV sender port (0: ephemeral)"
    )
    add_peers_flag(parser, env)
    add_flag(
        parser,
        "--kv-stores",
        env,
        type=csv,
        default=(),
        help="KV stores (h:p,...) to offload evicted blocks to and pull from, besides the "
        "registry's",
    )


def add_decode_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    add_server_flags(parser, 50062, env)
    add_engine_flags(parser, env)
    add_field_flags(parser, env, DecodeConfig, DECODE_FIELDS)
    add_peers_flag(parser, env)
    add_spec_flags(parser, env)


def add_peers_flag(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    """The prefill workers a worker may pull KV from (a decode worker: prompts; any worker:
    cached prefixes, docs/kv-cache.md), besides the registry's."""
    add_flag(
        parser,
        "--prefill-peers",
        env,
        type=csv,
        default=(),
        help="prefill workers (h:p,...) to pull KV from, besides the registry's",
    )


def add_spec_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    """Speculative decoding on a decode worker (off unless --speculative-method is set)."""
    add_field_flags(parser, env, SpeculativeConfig, SPEC_FIELDS, SPEC_FLAGS)


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    values = field_values(args, SpeculativeConfig, SPEC_FIELDS, SPEC_FLAGS)
    if values["method"] is None:
        if values["draft_model"] is not None:
            raise ValueError("--spec-draft-model needs --speculative-method draft")
        return None
    return SpeculativeConfig(**values)


def prefill_config(args: argparse.Namespace) -> PrefillConfig:
    return PrefillConfig(
        engine=engine_config(args),
        server=server_config(args),
        kv_backend=args.kv_backend,
        kv_port=args.kv_port,
        kv_verify=args.kv_verify == "on",
        ucx_tls=args.ucx_tls,
        ray_address=args.ray_address,
        prefill_peers=args.prefill_peers,
        kv_stores=args.kv_stores,
        redis=redis_config(args),
        worker_id=args.worker_id,
        **field_values(args, PrefillConfig, PREFILL_FIELDS),
    )


def decode_config(args: argparse.Namespace) -> DecodeConfig:
    return DecodeConfig(
        engine=dataclasses.replace(engine_config(args), speculative=speculative_config(args)),
        server=server_config(args),
        kv_backend=args.kv_backend,
        ray_address=args.ray_address,
        prefill_peers=args.prefill_peers,
        kv_verify=args.kv_verify == "on",
        ucx_tls=args.ucx_tls,
        redis=redis_config(args),
        worker_id=args.worker_id,
        **field_values(args, DecodeConfig, DECODE_FIELDS),
    )
