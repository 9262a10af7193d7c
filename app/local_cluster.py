"""A local pdserve cluster: router, prefill and decode workers as separate processes, each one
restarted when it exits unexpectedly (as Ray and kubelet do).

Used by ``pdserve up`` and by the integration tests. Flags given for a pool are parsed here,
once, into the component's frozen config (with this process's environment, which the children
inherit); each child gets that whole config as JSON on its stdin (``pdserve serve-config``,
``settings/serialized.py``), so a restart changes typed fields, never argv. Each component prints
``pdserve <role> ready <host:port>`` once its health service turns SERVING; the cluster waits for
that line (bounded), so no caller ever sleeps to guess readiness.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from app import settings
from app.component import Component, start_component
from app.cpu_share import CoreShare, WorkerConfig
from app.settings import ServiceConfig
from decode_service.config import DecodeConfig
from kvstore_service.config import KVStoreConfig
from pdserve.common.role import Role
from prefill_service.config import PrefillConfig
from router.config import RouterConfig


@dataclass(frozen=True)
class ClusterConfig:
    model: str
    num_prefill: int = 1
    num_decode: int = 1
    num_kvstore: int = 0  # KV stores (docs/kv-cache.md)
    kvstore_args: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    router_port: int = 0
    router_http_port: int | None = None  # the OpenAI HTTP API (0: ephemeral); None: off
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    # With Redis, workers register and the router discovers them (and routes cache-aware);
    # without, the router gets static address lists.
    redis_url: str | None = None
    redis_namespace: str = "pdserve"  # key prefix: clusters sharing one Redis stay apart
    log_dir: Path | None = None  # each component's stderr goes to <log_dir>/<name>.log
    log_level: str = "INFO"
    ready_timeout_s: float = 300.0
    # The colocated baseline: decode workers prefill and decode (num_prefill may be 0).
    colocated: bool = False
    stop_timeout_s: float = 30.0
    # Supervision: a component that exits non-zero (killed, crashed, a dead engine) is started
    # again after a delay that doubles from restart_delay_s up to restart_delay_max_s, at most
    # max_restarts times each. Exit 0 means it was asked to stop (a drain) and is left down.
    max_restarts: int = 5
    restart_delay_s: float = 1.0
    restart_delay_max_s: float = 30.0
    # Every component's token for internal calls (pdserve/common/peer_token.py); "": none.
    peer_token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.num_decode < 1 or self.num_prefill < (0 if self.colocated else 1):
            raise ValueError(
                "a cluster needs num_decode >= 1 and num_prefill >= 1 (0 when colocated)"
            )
        if self.num_kvstore < 0:
            raise ValueError(f"num_kvstore must be >= 0, got {self.num_kvstore}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not 0 < self.restart_delay_s <= self.restart_delay_max_s:
            raise ValueError("need 0 < restart_delay_s <= restart_delay_max_s")


def restart_delay_s(num_restarts: int, first_s: float, max_s: float) -> float:
    """The wait before restart number ``num_restarts + 1``: doubling, capped."""
    return float(min(first_s * 2**num_restarts, max_s))


class LocalCluster:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.prefill: list[Component] = []
        self.decode: list[Component] = []
        self.kvstores: list[Component] = []
        self.router: Component | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # the component lists, against the supervisors
        self._draining: list[Component] = []  # asked to go (a scale-down)
        self.num_restarts = 0  # over all components
        # Each component's last-known workers (a restart during a Redis outage reads them).
        self._state_dir = tempfile.TemporaryDirectory(prefix="pdserve-up-")
        # vLLM ranks get cores of their own (vLLM's default binds each to a whole NUMA node).
        skip = settings.environment_vllm_cpu_bind() is not None
        self._cores = CoreShare(sorted(os.sched_getaffinity(0)), skip)

    def _redis_args(self, name: str) -> list[str]:
        cfg = self.config
        if not cfg.redis_url:
            return []
        last_known = os.path.join(self._state_dir.name, f"{name}-workers.json")
        return [
            *("--redis", cfg.redis_url, "--redis-namespace", cfg.redis_namespace),
            *("--last-known-workers", last_known),
        ]

    @property
    def state_dir(self) -> str:
        """The supervisor's private directory (0700, removed at stop): last-known workers, the
        control token."""
        return self._state_dir.name

    @property
    def address(self) -> str:
        assert self.router is not None, "cluster not started"
        return self.router.address

    @property
    def http_url(self) -> str:
        """The router's OpenAI API base URL (no ``/v1``), when ``router_http_port`` is set."""
        assert self.router is not None and self.router.http_address, "no HTTP frontend"
        return f"http://{self.router.http_address}"

    @property
    def components(self) -> list[Component]:
        with self._lock:
            router = [self.router] if self.router else []
            return [*self.kvstores, *self.prefill, *self.decode, *router]

    def _spawn(self, name: str, config: ServiceConfig, restarts: int = 0) -> Component:
        cfg = self.config
        if not isinstance(config, RouterConfig):
            # A readable registry id per incarnation, for `pdserve status` and `pdserve drain`.
            config = dataclasses.replace(config, worker_id=f"{name}-{uuid.uuid4().hex[:6]}")
        if cfg.peer_token:
            server = dataclasses.replace(config.server, peer_token=cfg.peer_token)
            config = dataclasses.replace(config, server=server)
        return start_component(name, config, cfg.log_dir, cfg.log_level, restarts)

    def _group(self, role: Role) -> list[Component]:
        return self.prefill if role is Role.PREFILL else self.decode

    def _worker_config(
        self, role: Role, name: str, extra_args: tuple[str, ...] = ()
    ) -> WorkerConfig:
        cfg = self.config
        args = ["--host", cfg.host, "--port", "0", "--metrics-port", "0", "--model", cfg.model]
        args += self._redis_args(name)
        if role is Role.PREFILL:
            args += ["--kv-port", "0", *cfg.prefill_args]
            if not cfg.redis_url and self.kvstores:  # no registry to learn them from
                args += ["--kv-stores", ",".join(s.address for s in self.kvstores)]
        else:
            if not cfg.redis_url and self.prefill:
                # No registry to learn them from: the prefill workers it may pull KV from.
                args += ["--prefill-peers", ",".join(w.address for w in self.prefill)]
            args += list(cfg.decode_args)
        config = settings.parse_service_flags(role, [*args, *extra_args], with_environment=True)
        assert isinstance(config, PrefillConfig | DecodeConfig)
        return config

    def _kvstore_config(self, i: int) -> KVStoreConfig:
        cfg = self.config
        name = f"kvstore-{i}"
        args = ["--host", cfg.host, "--port", "0", "--metrics-port", "0", "--model", cfg.model]
        args += ["--kv-port", "0", *self._redis_args(name), *cfg.kvstore_args]
        config = settings.parse_service_flags(Role.KVSTORE, args, with_environment=True)
        assert isinstance(config, KVStoreConfig)
        return config

    def spawn_worker(self, role: Role, extra_args: tuple[str, ...] = ()) -> Component:
        """Starts one more prefill or decode worker (not waited for). Bad flags: ValueError."""
        with self._lock:
            name = f"{role.value}-{len(self._group(role))}"
        config = self._cores.bind(self._worker_config(role, name, extra_args))
        with self._lock:
            component = self._spawn(name, config)
            self._group(role).append(component)
        return component

    def live_workers(self, role: Role) -> list[Component]:
        """The role's workers that run and are not draining (the pool's size)."""
        with self._lock:
            group = self._group(role)
            return [c for c in group if c.process.poll() is None and c not in self._draining]

    def add_worker(self, role: Role) -> Component:
        """One more worker, started, supervised, and ready (it registers itself in Redis).
        One that fails to start is killed and forgotten; none starts once stopping."""
        if self._stopping.is_set():
            raise RuntimeError("the cluster is stopping")
        worker = self.spawn_worker(role)
        try:
            worker.wait_ready(self.config.ready_timeout_s)
        except BaseException:
            worker.kill()
            worker.process.wait()
            worker.cut_lifeline()
            with self._lock:
                self._group(role).remove(worker)
            raise
        self._supervise(worker)
        return worker

    def drain_worker(self, worker: Component) -> None:
        """SIGTERM: the worker drains (finishes its requests) and exits 0, so it stays down."""
        with self._lock:
            self._draining.append(worker)
        if worker.process.poll() is None:
            worker.process.send_signal(signal.SIGTERM)

    def start(self) -> LocalCluster:
        cfg = self.config
        planned = [(Role.PREFILL, cfg.num_prefill), (Role.DECODE, cfg.num_decode)]
        self._cores.plan([(self._worker_config(role, role.value), n) for role, n in planned if n])
        try:
            for i in range(cfg.num_kvstore):
                self.kvstores.append(self._spawn(f"kvstore-{i}", self._kvstore_config(i)))
            for store in self.kvstores:  # prefill workers offload to them from the start
                store.wait_ready(cfg.ready_timeout_s)
            for _ in range(cfg.num_prefill):
                self.spawn_worker(Role.PREFILL)
            if not cfg.redis_url:  # decode workers are told their prefill peers' addresses
                for worker in self.prefill:
                    worker.wait_ready(cfg.ready_timeout_s)
            for _ in range(cfg.num_decode):
                self.spawn_worker(Role.DECODE)
            for worker in [*self.prefill, *self.decode]:
                if not worker.address:
                    worker.wait_ready(cfg.ready_timeout_s)
            router_args = [
                "--host",
                cfg.host,
                "--port",
                str(cfg.router_port),
                "--metrics-port",
                "0",
                "--model",
                cfg.model,
                *cfg.router_args,
            ]
            if cfg.router_http_port is not None:
                router_args += ["--http-port", str(cfg.router_http_port)]
            if cfg.colocated:
                router_args.append("--colocated")
            if cfg.redis_url:
                router_args += self._redis_args(Role.ROUTER.value)
            else:
                if self.prefill:
                    router_args += ["--prefill", ",".join(w.address for w in self.prefill)]
                router_args += ["--decode", ",".join(w.address for w in self.decode)]
            router = settings.parse_service_flags(Role.ROUTER, router_args, with_environment=True)
            self.router = self._spawn(Role.ROUTER.value, router)
            self.router.wait_ready(cfg.ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        for component in self.components:
            self._supervise(component)
        return self

    # ---- supervision ------------------------------------------------------------------------
    def _supervise(self, component: Component) -> None:
        if self.config.max_restarts > 0:
            threading.Thread(target=self._watch, args=(component,), daemon=True).start()

    def _watch(self, component: Component) -> None:
        """Waits for the process to end; unless the cluster is stopping or the process exited
        0 (it was asked to: ``pdserve drain``), starts it again."""
        cfg = self.config
        code = component.process.wait()
        component.cut_lifeline()
        if code == 0 or component in self._draining:  # asked to stop (drain, scale-down)
            return
        while not self._stopping.is_set() and component.num_restarts < cfg.max_restarts:
            delay = restart_delay_s(
                component.num_restarts, cfg.restart_delay_s, cfg.restart_delay_max_s
            )
            print(
                f"pdserve up: {component.name} exited with {code}; restarting in {delay:g} s "
                f"(restart {component.num_restarts + 1} of {cfg.max_restarts})",
                file=sys.stderr,
                flush=True,
            )
            if self._stopping.wait(delay):
                return
            replacement = self._restart(component)
            if replacement is None:
                return
            try:
                replacement.wait_ready(cfg.ready_timeout_s)
            except (TimeoutError, RuntimeError):
                replacement.kill()
                code = replacement.process.wait()
                replacement.cut_lifeline()
                component = replacement
                continue
            self._supervise(replacement)
            return
        if not self._stopping.is_set():
            print(f"pdserve up: {component.name} stays down", file=sys.stderr, flush=True)

    def _restart(self, old: Component) -> Component | None:
        # Peers know it by its address (static lists, the router's port, and last-known
        # workers while Redis is down): keep its ports, as a restarted container in its pod.
        config = _same_ports(old.config, old)
        with self._lock:
            if self._stopping.is_set():
                return None
            new = self._spawn(old.name, config, old.num_restarts + 1)
            for group in (self.prefill, self.decode, self.kvstores):
                if old in group:
                    group[group.index(old)] = new
            if self.router is old:
                self.router = new
            self.num_restarts += 1
        return new

    def stop(self) -> dict[str, int]:
        """SIGTERM (a graceful drain) to the workers, then the router: the workers finish their
        streams while the router still relays them. SIGKILL past stop_timeout_s. Exit codes."""
        self._stopping.set()
        codes: dict[str, int] = {}
        with self._lock:
            workers = [*self.prefill, *self.decode]
            groups = (workers, self.kvstores, [self.router] if self.router else [])
        for group in groups:
            for c in group:
                if c.process.poll() is None:
                    c.process.send_signal(signal.SIGTERM)
            for c in group:
                try:
                    codes[c.name] = c.process.wait(timeout=self.config.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    c.kill()
                    codes[c.name] = c.process.wait()
                c.cut_lifeline()
        self._state_dir.cleanup()
        return codes

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _same_ports(config: ServiceConfig, old: Component) -> ServiceConfig:
    """``config`` bound to the ports ``old`` had (it asked for ephemeral ones, or not)."""
    port = old.address.rpartition(":")[2]
    if port:
        config = dataclasses.replace(
            config, server=dataclasses.replace(config.server, port=int(port))
        )
    http_port = old.http_address.rpartition(":")[2]
    if http_port and isinstance(config, RouterConfig) and config.http_port is not None:
        config = dataclasses.replace(config, http_port=int(http_port))
    return config
