"""``pdserve autoscale``: the command line of the control loop (``autoscaler.py``) and its
targets (``scale_target.py``): a ``pdserve up`` cluster, a ``pdserve ray up`` deployment, or
Kubernetes Deployments."""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from app import settings
from app.capacity.scaling import ScalingPolicy
from app.settings import add_flag
from app.settings.flags import field_default
from pdserve.common.tls import DEFAULT_SERVER_NAME

if TYPE_CHECKING:
    from app.capacity.scale_target import ScaleTarget


def _cmd_autoscale(args: argparse.Namespace) -> int:
    from app.capacity.scale_target import (
        LocalTarget,
        PoolRef,
        kubernetes_target,
    )
    from app.capacity.scaling import Bounds
    from pdserve.common.role import Role

    policy = ScalingPolicy(
        slo_ttft_s=args.slo_ttft_ms / 1e3,
        slo_tpot_s=args.slo_tpot_ms / 1e3,
        prefill=Bounds(args.min_prefill, args.max_prefill),
        decode=Bounds(args.min_decode, args.max_decode),
        interval_s=args.interval_s,
        cooldown_s=args.cooldown_s,
        down_after_intervals=args.down_after_intervals,
        utilization=args.utilization,
        correct_profile=not args.no_correction,
        kv_target=args.kv_target,
        slo_attainment=args.slo_attainment,
    )
    urls = list(args.metrics_url)
    if args.target == "local":
        if not args.control:
            raise ValueError("--target local needs --control HOST:PORT (pdserve up --control-port)")
        token = None
        if args.control_token_file:
            with open(args.control_token_file) as f:
                token = f.read().strip()
        local = LocalTarget(args.control, tls=settings.tls_config(args), token=token)
        return _autoscale(args, policy, local, lambda: urls or [local.router_metrics_url()])
    if args.target == "ray":
        from app.capacity.scale_target import RayTarget
        from app.ray_deploy import deployment

        deployment.connect(args.ray_address, args.ray_namespace)
        ray_target = RayTarget(args.ray_namespace)
        return _autoscale(
            args, policy, ray_target, lambda: urls or [ray_target.router_metrics_url()]
        )
    names = ("prefill_deployment", "decode_deployment", "prefill_selector", "decode_selector")
    missing = ["--" + n.replace("_", "-") for n in names if not getattr(args, n)]
    if missing:
        raise ValueError(f"--target kubernetes needs {', '.join(missing)}")
    if not urls and not args.router_selector:
        raise ValueError("--target kubernetes needs --metrics-url or --router-selector")
    pools = {
        Role.PREFILL: PoolRef(
            args.prefill_deployment, args.prefill_selector, args.worker_metrics_port[0]
        ),
        Role.DECODE: PoolRef(
            args.decode_deployment, args.decode_selector, args.worker_metrics_port[1]
        ),
    }
    kubernetes = kubernetes_target(args.namespace, pools, args.kubeconfig)

    def routers() -> list[str]:
        found = list(urls)
        if args.router_selector:
            found += kubernetes.metrics_urls(args.router_selector, args.router_metrics_port)
        return found

    return _autoscale(args, policy, kubernetes, routers)


def _autoscale(
    args: argparse.Namespace,
    policy: ScalingPolicy,
    target: ScaleTarget,
    routers: Callable[[], list[str]],
) -> int:
    """The loop: ``--rounds`` rounds, or until the process is stopped."""
    from app.capacity import profile as profile_io
    from app.capacity.autoscaler import Autoscaler
    from app.capacity.load_meter import scrape, totals
    from app.capacity.prometheus_meter import PoolJobs, PrometheusMeter
    from app.capacity.scale_target import pool_pressure_of
    from pdserve.common.metrics_server import start_metrics_server

    if args.prometheus:  # every input from Prometheus: the routers' totals and the pools
        jobs = PoolJobs(args.router_job, args.prefill_job, args.decode_job)
        prometheus = PrometheusMeter(args.prometheus, jobs)
        scaler = Autoscaler(
            profile_io.load(args.profile),
            policy,
            prometheus.totals,
            target,
            dry_run=args.dry_run,
            pressure=prometheus.pressure,
        )
    else:  # the routers' own /metrics, and the workers' for the pools' state
        scaler = Autoscaler(
            profile_io.load(args.profile),
            policy,
            lambda now_s: {u: totals(scrape(u), now_s) for u in routers()},
            target,
            dry_run=args.dry_run,
            pressure=lambda: pool_pressure_of(target),
        )
    if args.metrics_port is not None:
        port = start_metrics_server(args.host, args.metrics_port)
        print(f"pdserve autoscale metrics {args.host}:{port}", flush=True)
    stop = threading.Event()
    if args.rounds:
        for _ in range(args.rounds):
            scaler.tick()
            if stop.wait(policy.interval_s):
                break
        return 0
    scaler.run(stop)
    return 0


def add_autoscale_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    auto = sub.add_parser("autoscale", help="size the pools from live load (local, ray, k8s)")
    add_flag(auto, "--profile", type=Path, required=True)
    add_flag(auto, "--target", default="kubernetes", choices=("kubernetes", "local", "ray"))
    add_flag(auto, "--control", default=None, help="--target local: pdserve up's control address")
    add_flag(
        auto,
        "--control-token-file",
        default=None,
        help="--target local without TLS: the control-token file pdserve up printed",
    )
    for flag in ("--tls-cert", "--tls-key", "--tls-ca"):
        add_flag(auto, flag, default=None, help="--target local: the cluster's mutual TLS")
    add_flag(auto, "--tls-server-name", default=DEFAULT_SERVER_NAME, help="its certificate name")
    add_flag(auto, "--ray-address", default="auto", help="--target ray: the Ray cluster")
    add_flag(auto, "--ray-namespace", default="pdserve", help="--target ray: the deployment's")
    add_flag(auto, "--metrics-url", action="append", default=[], help="a router's /metrics URL")
    add_flag(
        auto,
        "--prometheus",
        default=None,
        help="read every input from this Prometheus (its HTTP API) instead of the /metrics "
        "pages of the routers and workers: the routers' totals, the decode pool's KV usage, "
        "the prefill pool's queue",
    )
    for pool in ("router", "prefill", "decode"):
        add_flag(
            auto,
            f"--{pool}-job",
            default=f".*-{pool}",
            help=f"--prometheus: the job label (regex) of the {pool} series",
        )
    add_flag(
        auto,
        "--kv-target",
        type=float,
        default=field_default(ScalingPolicy, "kv_target"),
        help="the decode pool's KV usage it is sized for (higher: scale up)",
    )
    add_flag(
        auto,
        "--slo-attainment",
        type=float,
        default=field_default(ScalingPolicy, "slo_attainment"),
        help="share of requests with a TTFT (TPOT) target that must meet it: below, prefill "
        "(decode) grows (docs/slo.md)",
    )
    add_flag(auto, "--router-selector", default=None, help="router pods (each one scraped)")
    add_flag(auto, "--router-metrics-port", type=int, default=9090)
    add_flag(auto, "--namespace", default="default")
    add_flag(auto, "--kubeconfig", default=None, help="outside a pod (default: ~/.kube/config)")
    add_flag(auto, "--prefill-deployment", default=None, help="--target kubernetes")
    add_flag(auto, "--decode-deployment", default=None, help="--target kubernetes")
    add_flag(auto, "--prefill-selector", default=None, help="label selector of prefill pods")
    add_flag(auto, "--decode-selector", default=None, help="label selector of decode pods")
    add_flag(
        auto,
        "--worker-metrics-port",
        type=int,
        nargs=2,
        default=[9090, 9090],
        metavar=("PREFILL", "DECODE"),
        help="the pools' metrics ports",
    )
    add_flag(auto, "--slo-ttft-ms", type=float, required=True)
    add_flag(auto, "--slo-tpot-ms", type=float, required=True)
    add_flag(auto, "--interval-s", type=float, default=30.0)
    add_flag(auto, "--cooldown-s", type=float, default=120.0)
    add_flag(auto, "--down-after-intervals", type=int, default=3, help="hysteresis")
    add_flag(auto, "--utilization", type=float, default=0.8, help="busy share pools are sized for")
    for pool in ("prefill", "decode"):
        add_flag(auto, f"--min-{pool}", type=int, default=1)
        add_flag(auto, f"--max-{pool}", type=int, default=8)
    add_flag(auto, "--no-correction", action="store_true", help="trust the profile as measured")
    add_flag(auto, "--dry-run", action="store_true", help="decide and log, change nothing")
    add_flag(auto, "--rounds", type=int, default=0, help="stop after N rounds (0: run on)")
    add_flag(auto, "--host", default="0.0.0.0", help="where its own /metrics listens")
    add_flag(auto, "--metrics-port", type=int, default=None)
    auto.set_defaults(func=_cmd_autoscale)
