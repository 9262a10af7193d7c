"""The metrics server under idle sockets (a neighbour on a shared host, a port scanner): it
holds at most ``METRICS_MAX_CONNECTIONS`` connection threads, drops a silent connection after
``METRICS_IDLE_S``, and serves scrapes again once the idle ones are gone. Before, each idle
socket held a thread for ever: 5000 of them exhausted a worker's threads."""

from __future__ import annotations

import asyncio
import socket
import threading
import urllib.request

from pdserve.common import metrics
from tests.services.harness import wait_for

IDLE_SOCKETS = 200  # far past the cap; each one held a thread before


def _scrape(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def test_idle_sockets_hold_a_bounded_number_of_threads_and_are_dropped() -> None:
    port = metrics.start_metrics_server("127.0.0.1", 0)
    baseline = threading.active_count()
    cap = metrics.METRICS_MAX_CONNECTIONS

    async def run() -> None:
        sockets, most = [], 0
        try:
            for _ in range(IDLE_SOCKETS):
                sockets.append(socket.create_connection(("127.0.0.1", port), timeout=10))
                most = max(most, threading.active_count() - baseline)
        finally:
            for s in sockets:
                s.close()
        assert most <= cap, f"{most} connection threads for {IDLE_SOCKETS} idle sockets"

        async def scrapes() -> bool:
            return await asyncio.to_thread(_scrape, port)

        await wait_for(scrapes, 30.0, "a scrape once the idle sockets are gone", poll_s=0.1)

        async def threads_ended() -> bool:
            return threading.active_count() <= baseline + 1

        await wait_for(threads_ended, metrics.METRICS_IDLE_S + 30.0, "their threads end")

    asyncio.run(run())
