"""One component process of a local cluster (``app/local_cluster.py``): how it is
started (``pdserve serve-config``, its whole config on the first line of its stdin, in a process
group of its own), its stdout's announcements (ready, metrics, http), and its lifeline (the rest
of its stdin, kept open until it has exited: ``app/supervised.py``)."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from app import settings
from app.settings import ServiceConfig
from pdserve.common.role import Role
from router.config import RouterConfig


def start_component(
    name: str, config: ServiceConfig, log_dir: Path | None, log_level: str, restarts: int = 0
) -> Component:
    """Starts the process (not waited for): stderr to ``<log_dir>/<name>.log`` (appended to
    on a restart), stdout read for its announcements."""
    stderr = None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        stderr = (log_dir / f"{name}.log").open("a" if restarts else "w")
    command = [sys.executable, "-m", "app", "--log-level", log_level]
    try:
        process = subprocess.Popen(
            [*command, "serve-config"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            # A terminal's Ctrl-C reaches the supervisor alone, which stops the components in
            # order (LocalCluster.stop).
            process_group=0,
        )
    finally:
        if stderr is not None:
            stderr.close()  # the child has its own copy
    assert process.stdin is not None
    # A few KB, within a pipe's buffer; a child that died at once reports through its exit.
    # Then the pipe stays open, unwritten: the child's lifeline, closed once it has exited
    # (``cut_lifeline``) or when the supervisor is gone (the child then drains).
    with contextlib.suppress(BrokenPipeError):
        process.stdin.write(settings.to_json(config) + "\n")
        process.stdin.flush()
    component = Component(name, config, process)
    component.num_restarts = restarts
    return component


@dataclass
class Component:
    name: str
    config: ServiceConfig  # what the process was handed, its incarnation's worker id included
    process: subprocess.Popen[str]
    lines: queue.Queue[str | None] = field(default_factory=queue.Queue)
    address: str = ""
    metrics_address: str = ""
    http_address: str = ""  # the router's OpenAI API, when on
    num_restarts: int = 0

    def __post_init__(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    @property
    def role(self) -> Role:
        return settings.role_of(self.config)

    @property
    def worker_id(self) -> str:
        """Its registry id ("" for the router)."""
        return "" if isinstance(self.config, RouterConfig) else self.config.worker_id or ""

    def kill(self) -> None:
        """SIGKILL to its process group: the component and what it started (a vLLM worker's
        rank processes), at once."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)

    def cut_lifeline(self) -> None:
        """Closes this side of an exited child's lifeline (its stdin pipe)."""
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()

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
            if len(words) == 4 and words[0] == "pdserve" and words[2] == "http":
                self.http_address = words[3]
            if len(words) == 4 and words[0] == "pdserve" and words[2] == "ready":
                self.address = words[3]
                return self.address
