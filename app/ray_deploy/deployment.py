"""Deployments on Ray, by namespace: up, scale, status, down. What ``pdserve ray`` calls (and
the tests); the caller is a Ray driver connected to the cluster."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import ray

from app.ray_deploy.controller import Controller
from app.ray_deploy.service_actor import ServiceInfo
from app.ray_deploy.spec import CONTROLLER_NAME, DeploymentSpec
from pdserve.common.role import Role

logger = logging.getLogger(__name__)


REACH_TIMEOUT_S = 10.0
# A deployment's control calls (status, scale's bookkeeping, down's kill) on a cluster that
# answers connections but not calls must not wait forever.
CALL_TIMEOUT_S = 60.0


def resolve_address(address: str) -> str | None:
    """The host:port a Ray address names: itself, or for "auto" the cluster this machine last
    started (``/tmp/ray/ray_current_cluster``) or ``RAY_ADDRESS``; None when "auto" names none."""
    if address != "auto":
        return address.removeprefix("ray://")
    from ray._private.services import find_bootstrap_address

    found = os.environ.get("RAY_ADDRESS") or find_bootstrap_address(None)
    return found.removeprefix("ray://") if found else None


def check_reachable(address: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """Raises ConnectionError naming ``address`` unless something accepts TCP connections
    there within ``timeout_s``: ``ray.init`` against a dead address retries for minutes."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return
    except (OSError, ValueError) as exc:
        raise ConnectionError(f"the Ray cluster at {address} is unreachable: {exc}") from None


def connect(address: str, namespace: str, start_head: bool = False) -> None:
    """Joins the cluster at ``address`` ("auto": the one on this machine), failing within
    ``REACH_TIMEOUT_S`` naming it when nothing answers there. ``start_head``: with "auto" and
    no live cluster, start a local Ray head first; it outlives this process (``ray stop``
    ends it)."""
    if ray.is_initialized():
        return
    target = resolve_address(address)
    try:
        if target is None:
            raise ConnectionError("no Ray cluster is running on this machine (--address auto)")
        check_reachable(target)
    except ConnectionError:
        if not (start_head and address == "auto"):
            raise
        ray_cli = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
        command = [ray_cli, "start", "--head", "--disable-usage-stats", "--include-dashboard=false"]
        subprocess.run(command, check=True, capture_output=True, timeout=120)
    ray.init(address=address, namespace=namespace, logging_level=logging.WARNING)


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


def scale(
    namespace: str, role: Role, count: int, timeout_s: float | None = None
) -> list[ServiceInfo]:
    """``timeout_s``: how long to wait for new workers to serve (None: the controller's own
    ready and drain bounds only)."""
    return list(ray.get(controller(namespace).scale.remote(role, count), timeout=timeout_s))


def status(namespace: str) -> list[ServiceInfo]:
    return list(ray.get(controller(namespace).status.remote(), timeout=CALL_TIMEOUT_S))


def redis_url(namespace: str) -> str:
    return str(ray.get(controller(namespace).redis.remote(), timeout=CALL_TIMEOUT_S))


def down(namespace: str, drain_timeout_s: float = 30.0) -> None:
    """Drains and removes the deployment; a controller that does not finish within the drain
    bound (plus ``CALL_TIMEOUT_S``) is killed with what it owns."""
    handle = controller(namespace)
    try:
        ray.get(handle.down.remote(), timeout=drain_timeout_s + CALL_TIMEOUT_S)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError) as exc:
        logger.warning("the controller did not finish its drain (%s); killing it", exc)
    finally:
        ray.kill(handle, no_restart=True)


def router_address(infos: list[ServiceInfo]) -> str:
    return next(i.address for i in infos if i.role is Role.ROUTER)


def table(infos: list[ServiceInfo]) -> str:
    rows = [("ACTOR", "ROLE", "ADDRESS", "METRICS", "WORKER ID", "PID")]
    for i in infos:
        address = i.address or "(restarting)"
        rows.append(
            (i.name, i.role.value, address, i.metrics_address, i.worker_id, str(i.pid or ""))
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)
