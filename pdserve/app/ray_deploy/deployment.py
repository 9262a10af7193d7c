"""Deployments on Ray, by namespace: up, scale, status, down. What ``pdserve ray`` calls (and
the tests); the caller is a Ray driver connected to the cluster."""

from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import ray

from pdserve.app.ray_deploy.controller import Controller
from pdserve.app.ray_deploy.service_actor import ServiceInfo
from pdserve.app.ray_deploy.spec import CONTROLLER_NAME, DeploymentSpec

logger = logging.getLogger(__name__)


def connect(address: str, namespace: str) -> None:
    """Joins the cluster at ``address`` ("auto": the one on this machine). With "auto" and no
    cluster running, starts a local Ray head first; it outlives this process
    (``ray stop`` ends it)."""
    if ray.is_initialized():
        return
    try:
        ray.init(address=address, namespace=namespace, logging_level=logging.WARNING)
    except ConnectionError:
        if address != "auto":
            raise
        ray_cli = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
        command = [ray_cli, "start", "--head", "--disable-usage-stats", "--include-dashboard=false"]
        subprocess.run(command, check=True, capture_output=True, timeout=120)
        ray.init(address="auto", namespace=namespace, logging_level=logging.WARNING)


def controller(namespace: str) -> Any:
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=namespace)
    except ValueError:
        raise ValueError(f"no pdserve deployment in Ray namespace {namespace!r}") from None


def up(spec: DeploymentSpec, namespace: str) -> list[ServiceInfo]:
    """Starts the deployment and returns once every actor serves."""
    try:
        controller(namespace)
    except ValueError:
        pass
    else:
        raise ValueError(f"a pdserve deployment already runs in Ray namespace {namespace!r}")
    actor = ray.remote(Controller).options(
        name=CONTROLLER_NAME,
        namespace=namespace,
        lifetime="detached",  # outlives `pdserve ray up`
        num_cpus=0,
        max_concurrency=8,  # status answers while a scale waits
        max_restarts=spec.max_restarts,  # a restarted controller redeploys from its spec
    )
    handle: Any = actor.remote(spec, namespace)
    try:
        return list(ray.get(handle.wait_ready.remote()))
    except BaseException:
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(handle.down.remote(), timeout=spec.drain_timeout_s + 30)  # stops its Redis
        ray.kill(handle, no_restart=True)  # takes the actors it owns with it
        raise


def scale(namespace: str, role: str, count: int) -> list[ServiceInfo]:
    return list(ray.get(controller(namespace).scale.remote(role, count)))


def status(namespace: str) -> list[ServiceInfo]:
    return list(ray.get(controller(namespace).status.remote()))


def redis_url(namespace: str) -> str:
    return str(ray.get(controller(namespace).redis.remote()))


def down(namespace: str) -> None:
    """Drains and removes the deployment."""
    handle = controller(namespace)
    try:
        ray.get(handle.down.remote())
    finally:
        ray.kill(handle, no_restart=True)


def router_address(infos: list[ServiceInfo]) -> str:
    return next(i.address for i in infos if i.role == "router")


def table(infos: list[ServiceInfo]) -> str:
    rows = [("ACTOR", "ROLE", "ADDRESS", "METRICS", "WORKER ID", "PID")]
    for i in infos:
        address = i.address or "(restarting)"
        rows.append((i.name, i.role, address, i.metrics_address, i.worker_id, str(i.pid or "")))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)
