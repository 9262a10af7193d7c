"""``pdserve ray up|scale|status|down``: the command line of Ray deployments."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from app.settings import (
    add_cluster_flags,
    add_flag,
    decode_passthrough,
    layout_of,
    router_passthrough,
    tracing_passthrough,
    worker_passthrough,
)
from pdserve.common.role import WORKER_ROLES, Role

if TYPE_CHECKING:
    from app.ray_deploy.spec import DeploymentSpec


def _run(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Ray's errors carry the remote traceback; the command line shows their cause."""

    def run(args: argparse.Namespace) -> int:
        from ray.exceptions import RayError

        try:
            return command(args)
        except RayError as exc:
            cause = getattr(exc, "cause", None) or exc
            print(f"pdserve: error: {cause}", file=sys.stderr)
            return 1
        except ConnectionError as exc:
            print(f"pdserve: error: {exc}", file=sys.stderr)
            return 1

    return run


def _deployment_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(
        parser,
        "--address",
        default="auto",
        help="Ray cluster: auto, the GCS HOST:PORT (on a Ray node), or ray://HEAD:10001",
    )
    add_flag(parser, "--namespace", default="pdserve", help="Ray namespace of the deployment")


def _deployment_spec(args: argparse.Namespace) -> DeploymentSpec:
    from app.ray_deploy.spec import deployment_spec

    traced = tracing_passthrough(args)  # every component traces to the same collector
    return deployment_spec(
        model=args.model,
        num_prefill=args.prefill,
        num_decode=args.decode,
        num_gpus_per_worker=args.num_gpus_per_worker,
        num_cpus_per_worker=args.num_cpus_per_worker,
        kv_backend=args.kv_backend,
        redis_url=args.redis,
        router_port=args.port,
        max_restarts=args.max_restarts,
        layout=layout_of(args),
        prefill_args=[*traced, *worker_passthrough(args), *shlex.split(args.prefill_args)],
        decode_args=[*traced, *decode_passthrough(args), *shlex.split(args.decode_args)],
        router_args=[*traced, *router_passthrough(args), *shlex.split(args.router_args)],
        num_kvstore=args.kvstore,
        kvstore_args=[*traced, *shlex.split(args.kvstore_args)],
    )


def _cmd_up(args: argparse.Namespace) -> int:
    from app.ray_deploy import deployment

    spec = _deployment_spec(args)
    deployment.connect(args.address, args.namespace, start_head=True)
    infos = deployment.up(spec, args.namespace)
    print(deployment.table(infos))
    print(f"pdserve on ray ready: router {deployment.router_address(infos)}", flush=True)
    return 0


def _cmd_scale(args: argparse.Namespace) -> int:
    from app.ray_deploy import deployment

    deployment.connect(args.address, args.namespace)
    print(deployment.table(deployment.scale(args.namespace, Role(args.role), args.count)))
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from app.ray_deploy import deployment

    deployment.connect(args.address, args.namespace)
    print(deployment.table(deployment.status(args.namespace)))
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    from app.ray_deploy import deployment

    deployment.connect(args.address, args.namespace)
    deployment.down(args.namespace)
    print(f"pdserve deployment in namespace {args.namespace!r} drained and removed")
    return 0


def add_ray_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ray_parser = sub.add_parser("ray", help="deploy on a Ray cluster (up, scale, status, down)")
    commands = ray_parser.add_subparsers(dest="ray_command", required=True)

    up = commands.add_parser("up", help="start router and worker pools as Ray actors")
    _deployment_flags(up)
    # The embedded Redis (no --redis) is for single-node clusters only.
    add_cluster_flags(up, default_kv_backend="ray")
    add_flag(up, "--num-gpus-per-worker", type=float, default=0.0, help="Ray GPU request")
    add_flag(up, "--num-cpus-per-worker", type=float, default=1.0, help="Ray CPU request")
    add_flag(up, "--max-restarts", type=int, default=3, help="Ray restarts per crashed actor")
    up.set_defaults(func=_run(_cmd_up))

    scale = commands.add_parser("scale", help="resize one pool at runtime (drains on shrink)")
    _deployment_flags(scale)
    scale.add_argument("role", choices=[r.value for r in WORKER_ROLES])
    scale.add_argument("count", type=int)
    scale.set_defaults(func=_run(_cmd_scale))

    for name, func, text in (
        ("status", _cmd_status, "the deployment's actors and addresses"),
        ("down", _cmd_down, "drain and remove the deployment"),
    ):
        command = commands.add_parser(name, help=text)
        _deployment_flags(command)
        command.set_defaults(func=_run(func))
