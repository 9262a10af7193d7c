"""The autoscaler reading the pools' pressure while a worker is frozen (SIGSTOP: its kernel
still accepts the connection, nothing ever answers): that worker costs the round its page and
one scrape timeout, the others' pages are read, and once it runs again (SIGCONT) its page is
read again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from app.capacity.load_meter import gauges_at, reachable_gauges
from pdserve.common.metrics_server import start_metrics_server

# A worker's metrics page in a process of its own, with a value this process does not have.
_CHILD = """
import sys, threading
from pdserve.common import metrics
from pdserve.common.metrics_server import start_metrics_server
metrics.KV_BLOCKS_USED.set(7)
print(start_metrics_server("127.0.0.1", 0), flush=True)
threading.Event().wait()
"""


def test_a_frozen_worker_costs_its_page_not_the_round() -> None:
    live = f"http://127.0.0.1:{start_metrics_server('127.0.0.1', 0)}/metrics"
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        frozen = f"http://127.0.0.1:{int(child.stdout.readline())}/metrics"
        before = gauges_at(frozen)
        assert before is not None and before["pdserve_kv_blocks_used"] == 7
        os.kill(child.pid, signal.SIGSTOP)
        pages = reachable_gauges([frozen, live])
        assert len(pages) == 1 and pages[0].get("pdserve_kv_blocks_used") != 7, pages
        os.kill(child.pid, signal.SIGCONT)
        after = gauges_at(frozen)
        assert after is not None and after["pdserve_kv_blocks_used"] == 7
    finally:
        child.kill()
        child.wait(timeout=30)
