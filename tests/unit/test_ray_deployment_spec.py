"""The Ray deployment spec: validation, and the component flags it hands each actor (the same
flags as process mode)."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from pdserve.cluster.registry import Role
from pdserve.ray_deploy.spec import DeploymentSpec

REDIS = "redis://127.0.0.1:6379/0"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_prefill": 0}, "num_prefill >= 1"),
        ({"num_decode": 0}, "num_decode >= 1"),
        ({"num_gpus_per_worker": -1.0}, "num_gpus_per_worker"),
        ({"transfer": "nccl"}, "transfer must be ray or grpc"),
        ({"router_port": 70000}, "router_port"),
        ({"max_restarts": -1}, "max_restarts"),
        ({"drain_timeout_s": 0.0}, "drain_timeout_s"),
    ],
)
def test_bad_spec_is_rejected_naming_the_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DeploymentSpec(model="/m", **fields)  # type: ignore[arg-type]


def test_worker_flags_parse_as_the_process_mode_command() -> None:
    spec = DeploymentSpec(
        model="/m", num_gpus_per_worker=1, block_size=32, prefill_args=("--lease-s", "5")
    )
    args = build_parser().parse_args(spec.worker_argv(Role.PREFILL, REDIS))
    assert (args.command, args.model, args.redis, args.block_size) == ("prefill", "/m", REDIS, 32)
    assert (args.kv_backend, args.device, args.port, args.kv_port) == ("ray", "cuda", 0, 0)
    assert args.lease_s == 5.0  # extra flags come last, so they win
    decode = build_parser().parse_args(spec.worker_argv(Role.DECODE, REDIS))
    assert (decode.command, decode.kv_backend, decode.metrics_port) == ("decode", "ray", 0)


def test_cpu_workers_pick_their_own_device_and_router_gets_its_port() -> None:
    spec = DeploymentSpec(
        model="/m", transfer="grpc", router_port=0, router_args=("--cache-alpha", "2")
    )
    decode = build_parser().parse_args(spec.worker_argv(Role.DECODE, REDIS))
    assert decode.device is None and decode.kv_backend == "grpc"
    router = build_parser().parse_args(spec.router_argv(REDIS))
    assert (router.command, router.port, router.redis, router.cache_alpha) == (
        "router",
        0,
        REDIS,
        2.0,
    )
