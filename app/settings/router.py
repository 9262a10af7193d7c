"""The flags of ``pdserve router`` and its config. Part of ``app.settings``."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from app.settings.flags import (
    add_engine_flag,
    add_flag,
    add_kv_cache_dtype_flag,
    add_server_flags,
    csv,
    field_default,
    redis_config,
    server_config,
)
from engine.config import EngineBackend, block_size_for
from engine.dtypes import DTYPE_NAMES
from engine.kv_layout import KVCacheDtype
from router.config import RouterConfig
from router.limits import RequestLimits
from router.openai.tool_parsers import PARSERS
from router.policy import DECODE_POLICIES, RoutingPolicy


def add_router_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    add_server_flags(parser, 50051, env)
    add_flag(parser, "--model", env, required=True, help="model directory (tokenizer, config)")
    add_flag(parser, "--prefill", env, type=csv, default=(), help="static prefill workers h:p,...")
    add_flag(parser, "--decode", env, type=csv, default=(), help="static decode workers h:p,...")
    add_flag(
        parser,
        "--dtype",
        env,
        default=field_default(RouterConfig, "dtype"),
        choices=DTYPE_NAMES,
        help="the workers' dtype",
    )
    add_flag(
        parser,
        "--block-size",
        env,
        type=int,
        default=None,
        help="the workers' block size (default: the engine's, 16 native, 32 vllm)",
    )
    add_kv_cache_dtype_flag(parser, env, "the workers' KV cache dtype (part of the fingerprint)")
    add_engine_flag(parser, env)
    add_flag(
        parser,
        "--prefill-policy",
        env,
        default=field_default(RouterConfig, "prefill_policy"),
        choices=[p.value for p in RoutingPolicy],
        help="prefill worker choice",
    )
    add_flag(
        parser,
        "--decode-policy",
        env,
        default=field_default(RouterConfig, "decode_policy"),
        choices=[p.value for p in DECODE_POLICIES],
        help="decode worker choice",
    )
    add_flag(
        parser,
        "--cache-alpha",
        env,
        type=float,
        default=field_default(RouterConfig, "cache_alpha"),
        help="cache_aware load weight",
    )
    add_flag(
        parser,
        "--imbalance-tokens",
        env,
        type=int,
        default=field_default(RouterConfig, "imbalance_tokens"),
        help="cache_aware guard",
    )
    add_flag(
        parser,
        "--local-prefill-tokens",
        env,
        type=int,
        default=field_default(RouterConfig, "local_prefill_tokens"),
        help="prefill on the decode worker when fewer prompt tokens are uncached (0: never)",
    )
    add_flag(
        parser,
        "--admission-timeout-s",
        env,
        type=float,
        default=field_default(RouterConfig, "admission_timeout_s"),
    )
    add_flag(
        parser,
        "--colocated",
        env,
        action="store_true",
        help="no prefill pool: decode workers prefill every request themselves (baseline)",
    )
    add_flag(
        parser,
        "--ready-timeout-s",
        env,
        type=float,
        default=field_default(RouterConfig, "ready_timeout_s"),
        help="exit when no worker is ready after this long (default: wait, logging each 10 s)",
    )
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
        "--http-port",
        env,
        type=int,
        default=None,
        help="serve the OpenAI API over HTTP on this port too (0: ephemeral; unset: off)",
    )
    add_flag(
        parser,
        "--served-model-name",
        env,
        default=None,
        help="the model name clients pass in the OpenAI API (default: --model as given)",
    )
    add_flag(
        parser,
        "--tool-call-parser",
        env,
        default=None,
        choices=sorted(PARSERS),
        help="how tool_choice 'auto' calls are read out of the model's text (default: the "
        "format the chat template writes, if it names one)",
    )
    add_flag(
        parser,
        "--migration-limit",
        env,
        type=int,
        default=field_default(RouterConfig, "migration_limit"),
        help="times a broken stream is re-issued to another worker (0: never)",
    )
    add_flag(
        parser,
        "--quarantine-s",
        env,
        type=float,
        default=field_default(RouterConfig, "quarantine_s"),
        help="a prompt two workers went away running (before its first token) is refused this long",
    )
    add_flag(
        parser,
        "--stall-timeout-s",
        env,
        type=float,
        default=field_default(RouterConfig, "stall_timeout_s"),
        help="a worker stream silent this long (workers send heartbeats) counts as stalled",
    )
    add_flag(
        parser,
        "--client-idle-timeout-s",
        env,
        type=float,
        default=field_default(RouterConfig, "client_idle_timeout_s"),
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
        block_size=block_size_for(args.block_size, EngineBackend(args.engine)),
        kv_cache_dtype=KVCacheDtype.parse(args.kv_cache_dtype),
        engine=EngineBackend(args.engine),
        prefill_policy=RoutingPolicy(args.prefill_policy),
        decode_policy=RoutingPolicy(args.decode_policy),
        cache_alpha=args.cache_alpha,
        imbalance_tokens=args.imbalance_tokens,
        local_prefill_tokens=args.local_prefill_tokens,
        admission_timeout_s=args.admission_timeout_s,
        ready_timeout_s=args.ready_timeout_s,
        colocated=args.colocated,
        migration_limit=args.migration_limit,
        quarantine_s=args.quarantine_s,
        stall_timeout_s=args.stall_timeout_s,
        client_idle_timeout_s=args.client_idle_timeout_s,
        api_key_file=args.api_key_file,
        http_port=args.http_port,
        served_model_name=args.served_model_name,
        tool_call_parser=args.tool_call_parser,
        limits=RequestLimits(**{n: getattr(args, n) for n in RequestLimits.__dataclass_fields__}),
    )
