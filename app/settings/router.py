"""The flags of ``pdserve router`` and its config. Part of ``app.settings``."""

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
from router.config import RouterConfig
from router.flow_config import FlowConfig
from router.limits import RequestLimits
from router.openai.tool_parsers import PARSERS
from router.policy import DECODE_POLICIES, RoutingPolicy
from router.request_class import parse_classes

# The fields whose flags come from the config (``app/settings/config_flags.py``).
ROUTER_FIELDS = (
    "prefill_policy",
    "cache_alpha",
    "imbalance_tokens",
    "peer_pull_tokens_per_s",
    "peer_pull_overhead_s",
    "eviction_reuse",
    "host_load_tokens_per_s",
    "local_prefill_tokens",
    "admission_timeout_s",
    "colocated",
    "ready_timeout_s",
    "api_key_file",
    "http_port",
    "served_model_name",
    "migration_limit",
    "quarantine_s",
    "stall_timeout_s",
    "client_idle_timeout_s",
)

LIMIT_FIELDS = tuple(f.name for f in dataclasses.fields(RequestLimits))  # public: every one
FLOW_FIELDS = tuple(f.name for f in dataclasses.fields(FlowConfig) if f.name != "classes")


def add_router_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    add_server_flags(parser, 50051, env)
    add_flag(parser, "--model", env, required=True, help="model directory (tokenizer, config)")
    add_flag(parser, "--prefill", env, type=csv, default=(), help="static prefill workers h:p,...")
    add_flag(parser, "--decode", env, type=csv, default=(), help="static decode workers h:p,...")
    add_layout_flags(parser, env)  # the workers': discovered workers of another are refused
    add_flag(
        parser,
        "--decode-policy",
        env,
        default=field_default(RouterConfig, "decode_policy"),
        choices=[p.value for p in DECODE_POLICIES],
        help="decode worker choice",
    )
    add_field_flags(parser, env, RequestLimits, LIMIT_FIELDS)
    add_flag(
        parser,
        "--tool-call-parser",
        env,
        default=None,
        choices=sorted(PARSERS),
        help="how tool_choice 'auto' calls are read out of the model's text (default: the "
        "format the chat template writes, if it names one)",
    )
    add_field_flags(parser, env, RouterConfig, ROUTER_FIELDS)
    add_flag(
        parser,
        "--request-classes",
        env,
        default="",
        help="request classes, ';'-separated: NAME[:priority=P,ttft_s=S,tpot_s=S,"
        "queue_ttl_s=S,max_queued=N] (docs/slo.md; 'default' is always one)",
    )
    add_field_flags(parser, env, FlowConfig, FLOW_FIELDS)


def router_config(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        model=args.model,
        prefill_addresses=args.prefill,
        decode_addresses=args.decode,
        server=server_config(args),
        redis=redis_config(args),
        layout=layout_of(args),
        decode_policy=RoutingPolicy(args.decode_policy),
        tool_call_parser=args.tool_call_parser,
        limits=RequestLimits(**field_values(args, RequestLimits, LIMIT_FIELDS)),
        flow=FlowConfig(
            classes=parse_classes(args.request_classes),
            **field_values(args, FlowConfig, FLOW_FIELDS),
        ),
        **field_values(args, RouterConfig, ROUTER_FIELDS),
    )
