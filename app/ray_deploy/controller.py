"""The controller of one deployment on Ray: a detached actor that owns Redis (embedded unless
given), the router, the two worker pools and the KV stores, and changes them on request.

Ownership: the worker and router actors are the controller's (not detached), so they share its
fate; removing the controller removes the deployment. Each worker actor may be restarted by Ray
up to ``max_restarts`` times; scale-down and ``down`` drain before they kill, so no stream is
dropped.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import ray

from app.embedded_redis import EmbeddedRedis
from app.ray_deploy.service_actor import ServiceActor, ServiceInfo
from app.ray_deploy.spec import DeploymentSpec
from app.settings import ServiceConfig
from pdserve.common.role import Role

logger = logging.getLogger(__name__)

_INFO_TIMEOUT_S = 5.0


class Controller:
    def __init__(self, spec: DeploymentSpec, namespace: str) -> None:
        self.spec = spec
        self.namespace = namespace
        self._lock = threading.Lock()
        self._redis: EmbeddedRedis | None = None
        self.redis_url = spec.redis_url
        if not self.redis_url:
            if len([n for n in ray.nodes() if n["Alive"]]) > 1:
                raise ValueError(
                    "the embedded Redis listens on a local unix socket: a multi-node Ray "
                    "cluster needs --redis URL, reachable from every node"
                )
            self._redis = EmbeddedRedis().start()
            self._redis.supervise()  # the registry outlives a killed redis-server
            self.redis_url = self._redis.url
        self._router = self._spawn(Role.ROUTER.value, spec.router_config(self.redis_url), 0.0, 0.0)
        self._pools: dict[Role, dict[int, Any]] = {
            Role.KVSTORE: {},
            Role.PREFILL: {},
            Role.DECODE: {},
        }
        # KV stores first: the prefill workers look them up when they start.
        for index in range(spec.num_kvstore):
            self._add(Role.KVSTORE, index)
        stores = list(self._pools[Role.KVSTORE].values())
        ray.get([a.ready.remote(spec.ready_timeout_s) for a in stores])
        for role, count in ((Role.PREFILL, spec.num_prefill), (Role.DECODE, spec.num_decode)):
            for index in range(count):
                self._add(role, index)

    def _spawn(self, name: str, config: ServiceConfig, num_cpus: float, num_gpus: float) -> Any:
        actor = ray.remote(ServiceActor).options(
            name=f"pdserve-{name}",
            namespace=self.namespace,
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            max_restarts=self.spec.max_restarts,
            max_concurrency=4,  # ready/info/drain answer while another call waits
        )
        return actor.remote(f"pdserve-{name}", config)

    def _add(self, role: Role, index: int) -> Any:
        spec = self.spec
        store = role is Role.KVSTORE  # host memory and the network only: no model to run
        actor = self._spawn(
            f"{role.value}-{index}",
            spec.worker_config(role, self.redis_url),
            0.0 if store else spec.num_cpus_per_worker,
            0.0 if store else spec.num_gpus_per_worker,
        )
        self._pools[role][index] = actor
        return actor

    def redis(self) -> str:
        """The Redis URL every component uses (registry, prefix index)."""
        return self.redis_url

    def wait_ready(self) -> list[ServiceInfo]:
        """Blocks until every actor serves; raises the first failure (after Ray's restarts)."""
        with self._lock:
            actors = [self._router, *self._workers()]
        return list(ray.get([a.ready.remote(self.spec.ready_timeout_s) for a in actors]))

    def scale(self, role: Role, count: int) -> list[ServiceInfo]:
        """Grows a pool (returns once the new workers serve) or shrinks it, draining the
        workers it removes before they are killed."""
        if count < 1:
            raise ValueError(f"a {role.value} pool needs at least 1 worker, got {count}")
        with self._lock:
            pool = self._pools[role]
            added = []
            index = 0
            while len(pool) < count:
                if index not in pool:
                    added.append(self._add(role, index))
                index += 1
            # Dead or restarting workers go first, then the highest indices: scaling down and
            # up again replaces a worker whose restarts are exhausted.
            removed = []
            if len(pool) > count:
                dead = self._unresponsive(pool)
                order = sorted(pool, key=lambda i: (i not in dead, -i))
                removed = [pool.pop(i) for i in order[: len(pool) - count]]
        ray.get([a.ready.remote(self.spec.ready_timeout_s) for a in added])
        self._drain_and_kill(removed)
        return self.status()

    @staticmethod
    def _unresponsive(pool: dict[int, Any]) -> set[int]:
        refs = {i: actor.info.remote() for i, actor in pool.items()}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=_INFO_TIMEOUT_S)
        dead = set()
        for i, ref in refs.items():
            try:
                ray.get(ref, timeout=0)
            except (ray.exceptions.RayError, TimeoutError):
                ray.cancel(ref)
                dead.add(i)
        return dead

    def status(self) -> list[ServiceInfo]:
        """Every actor's info; one that does not answer (restarting) shows no address."""
        with self._lock:
            router = Role.ROUTER
            named: list[tuple[str, Role, Any]] = [(f"pdserve-{router.value}", router, self._router)]
            for kind, pool in self._pools.items():
                named += [(f"pdserve-{kind.value}-{i}", kind, a) for i, a in pool.items()]
        refs = [actor.info.remote() for _, _, actor in named]
        ray.wait(refs, num_returns=len(refs), timeout=_INFO_TIMEOUT_S)
        infos = []
        for (name, role, _), ref in zip(named, refs, strict=True):
            try:
                infos.append(ray.get(ref, timeout=0))
            except (ray.exceptions.RayError, TimeoutError):
                ray.cancel(ref)
                infos.append(ServiceInfo(name, role, "", "", "", 0, ""))
        return infos

    def down(self) -> None:
        """Router first (its in-flight streams finish), then every worker, then Redis."""
        with self._lock:
            workers = self._workers()
            for pool in self._pools.values():
                pool.clear()
        self._drain_and_kill([self._router])
        self._drain_and_kill(workers)
        if self._redis is not None:
            self._redis.stop()

    def _workers(self) -> list[Any]:
        return [a for pool in self._pools.values() for a in pool.values()]

    def _drain_and_kill(self, actors: list[Any]) -> None:
        timeout_s = self.spec.drain_timeout_s + 10.0
        refs = [a.drain.remote(self.spec.drain_timeout_s) for a in actors]
        for actor, ref in zip(actors, refs, strict=True):
            try:
                if not ray.get(ref, timeout=timeout_s):
                    logger.warning("an actor did not finish draining; killing it")
            except (ray.exceptions.RayError, TimeoutError) as exc:
                logger.warning("drain failed (%s); killing the actor", exc)
            ray.kill(actor, no_restart=True)
