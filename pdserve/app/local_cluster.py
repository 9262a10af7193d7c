"""A local pdserve cluster: router, prefill and decode workers as separate processes.

Used by ``pdserve up`` and by the integration tests. Each component prints
``pdserve <role> ready <host:port>`` once its health service turns SERVING; the cluster waits for
that line (bounded), so no caller ever sleeps to guess readiness.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType


@dataclass(frozen=True)
class ClusterConfig:
    model: str
    num_prefill: int = 1
    num_decode: int = 1
    host: str = "127.0.0.1"
    router_port: int = 0
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    # With Redis, workers register and the router discovers them (and routes cache-aware);
    # without, the router gets static address lists.
    redis_url: str | None = None
    log_dir: Path | None = None  # each component's stderr goes to <log_dir>/<name>.log
    log_level: str = "INFO"
    ready_timeout_s: float = 300.0
    # The colocated baseline: decode workers prefill and decode (num_prefill may be 0).
    colocated: bool = False
    stop_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.num_decode < 1 or self.num_prefill < (0 if self.colocated else 1):
            raise ValueError(
                "a cluster needs num_decode >= 1 and num_prefill >= 1 (0 when colocated)"
            )


@dataclass
class Component:
    name: str
    process: subprocess.Popen[str]
    lines: queue.Queue[str | None] = field(default_factory=queue.Queue)
    address: str = ""
    metrics_address: str = ""
    worker_id: str = ""

    def __post_init__(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_ready(self, timeout_s: float) -> str:
        while True:
            try:
                line = self.lines.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"{self.name} not ready within {timeout_s} s") from None
            if line is None:
                raise RuntimeError(f"{self.name} exited with {self.process.wait()} before ready")
            words = line.split()
            if len(words) == 4 and words[0] == "pdserve" and words[2] == "metrics":
                self.metrics_address = words[3]
            if len(words) == 4 and words[0] == "pdserve" and words[2] == "ready":
                self.address = words[3]
                return self.address


class LocalCluster:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.prefill: list[Component] = []
        self.decode: list[Component] = []
        self.router: Component | None = None

    @property
    def address(self) -> str:
        assert self.router is not None, "cluster not started"
        return self.router.address

    @property
    def components(self) -> list[Component]:
        return [*self.prefill, *self.decode, *([self.router] if self.router else [])]

    def _spawn(self, name: str, role: str, args: list[str]) -> Component:
        cfg = self.config
        stderr = None
        if cfg.log_dir is not None:
            cfg.log_dir.mkdir(parents=True, exist_ok=True)
            stderr = (cfg.log_dir / f"{name}.log").open("w")
        command = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "--log-level",
            cfg.log_level,
            role,
            *args,
        ]
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        return Component(name, process)

    def spawn_worker(self, role: str, extra_args: tuple[str, ...] = ()) -> Component:
        """Starts one more prefill or decode worker (not waited for)."""
        cfg = self.config
        args = ["--host", cfg.host, "--port", "0", "--metrics-port", "0", "--model", cfg.model]
        if cfg.redis_url:
            args += ["--redis", cfg.redis_url]
        if role == "prefill":
            args += ["--kv-port", "0", *cfg.prefill_args]
        else:
            args += list(cfg.decode_args)
        group = self.prefill if role == "prefill" else self.decode
        name = f"{role}-{len(group)}"
        worker_id = f"{name}-{uuid.uuid4().hex[:6]}"
        # A readable registry id, for `pdserve status` and `pdserve drain`.
        component = self._spawn(name, role, [*args, "--worker-id", worker_id, *extra_args])
        component.worker_id = worker_id
        group.append(component)
        return component

    def start(self) -> LocalCluster:
        cfg = self.config
        try:
            for _ in range(cfg.num_prefill):
                self.spawn_worker("prefill")
            for _ in range(cfg.num_decode):
                self.spawn_worker("decode")
            for worker in [*self.prefill, *self.decode]:
                worker.wait_ready(cfg.ready_timeout_s)
            router_args = [
                "--host", cfg.host,
                "--port", str(cfg.router_port),
                "--metrics-port", "0",
                "--model", cfg.model,
                *cfg.router_args,
            ]  # fmt: skip
            if cfg.colocated:
                router_args.append("--colocated")
            if cfg.redis_url:
                router_args += ["--redis", cfg.redis_url]
            else:
                if self.prefill:
                    router_args += ["--prefill", ",".join(w.address for w in self.prefill)]
                router_args += ["--decode", ",".join(w.address for w in self.decode)]
            self.router = self._spawn("router", "router", router_args)
            self.router.wait_ready(cfg.ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> dict[str, int]:
        """SIGTERM (graceful drain), router first; SIGKILL past stop_timeout_s. Exit codes."""
        codes: dict[str, int] = {}
        for group in ([self.router] if self.router else [], [*self.prefill, *self.decode]):
            for c in group:
                if c.process.poll() is None:
                    c.process.send_signal(signal.SIGTERM)
            for c in group:
                try:
                    codes[c.name] = c.process.wait(timeout=self.config.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    c.process.kill()
                    codes[c.name] = c.process.wait()
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
