"""The metrics port under hostile sockets (a neighbour on a shared host, a port scanner, a
slowloris): /livez and /metrics answer while hundreds of silent and trickling connections are
open; each of those is closed within its bound from accept (a trickle a byte at a time
included); no thread is spent per connection. Before, 32 trickling sockets (a byte every 4 s,
under the 5 s per-read timeout) held every slot, /livez failed and the kubelet would have
restarted a healthy worker (pdserve/common/metrics_server.py)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import urllib.error
import urllib.request

from pdserve.common.metrics_server import MAX_WAITING, REQUEST_S, start_metrics_server
from tests.services.harness import wait_for

SILENT = 200  # far past MAX_WAITING
TRICKLING = 40


def _get(port: int, path: str) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def _threads() -> list[str]:
    """This process's threads, less the test's own ``asyncio.to_thread`` workers."""
    return sorted(t.name for t in threading.enumerate() if not t.name.startswith("asyncio_"))


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (EOF, a reset, or an answer then EOF)."""
    sock.settimeout(0.0)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_probes_answer_while_hostile_sockets_are_held_and_those_are_closed() -> None:
    alive = {"ok": True}
    port = start_metrics_server("127.0.0.1", 0, alive=lambda: alive["ok"])
    threads = _threads()

    async def run() -> None:
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(SILENT)]
        trickling = [socket.create_connection(("127.0.0.1", port)) for _ in range(TRICKLING)]
        opened = time.monotonic()
        try:
            for k in range(3):  # a byte each, again and again, never a whole head
                for s in trickling:
                    s.send(b"GET /livez HTTP/1.1\r\n"[k : k + 1])
                # Probes and a scrape answer while all of them are open.
                assert await asyncio.to_thread(_get, port, "/livez") == 200
                assert await asyncio.to_thread(_get, port, "/metrics") == 200
                await asyncio.sleep(0.5)
            alive["ok"] = False
            assert await asyncio.to_thread(_get, port, "/livez") == 503  # it still tells

            async def all_closed() -> bool:
                return all(_closed(s) for s in silent + trickling)

            await wait_for(all_closed, REQUEST_S + 30.0, "every hostile socket is closed")
            # Within the bound from accept, however long the test took to look.
            assert time.monotonic() - opened >= REQUEST_S
            assert _threads() == threads  # no thread per connection
        finally:
            for s in silent + trickling:
                s.close()

    asyncio.run(run())
    assert MAX_WAITING < SILENT  # the bound was passed: evictions, not only timeouts
