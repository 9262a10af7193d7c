"""A Ray address nobody answers at: ``pdserve up --kv-backend ray`` and ``pdserve ray down`` fail
within 30 s naming it (instead of retrying for minutes), and ``pdserve up --kv-backend ray``
without an address starts a Ray of its own instead of attaching to whatever cluster the
machine last ran. Nothing here writes the session's ``/tmp/ray``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from pdserve.v1 import common_pb2, router_pb2
from tests.integration.cluster_util import generate_many, run

pytestmark = pytest.mark.slow


def _closed_port() -> str:
    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _pdserve(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, float]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "app", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    return done.returncode, done.stderr, time.monotonic() - start


def test_up_with_an_unreachable_ray_address_fails_fast_naming_it(llama_dir: Path) -> None:
    address = _closed_port()
    args = ("up", "--model", str(llama_dir), "--kv-backend", "ray", "--ray-address", address)
    code, err, took_s = _pdserve(*args)
    assert code != 0 and address in err and "unreachable" in err, err
    assert took_s < 30


def test_ray_down_against_an_unreachable_cluster_fails_fast_naming_it() -> None:
    address = _closed_port()
    code, err, took_s = _pdserve("ray", "down", "--address", address, "--namespace", "x")
    assert code == 1 and address in err and "unreachable" in err, err
    assert took_s < 30


def test_up_with_ray_transfer_and_no_address_starts_its_own_ray(llama_dir: Path) -> None:
    # This machine "last ran" a cluster that is gone: plain ray.init() would attach to it and
    # hang. The file lives in a temp dir of this test's own, not in the session's /tmp/ray
    # (short: Ray's unix socket paths must fit in 107 bytes).
    with tempfile.TemporaryDirectory(prefix="pdray", dir="/tmp") as short:
        _up_without_an_address(llama_dir, Path(short))


def _up_without_an_address(llama_dir: Path, ray_tmp: Path) -> None:
    (ray_tmp / "ray").mkdir(parents=True)
    (ray_tmp / "ray" / "ray_current_cluster").write_text(_closed_port())
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp), "RAY_ADDRESS": ""}
    command = [sys.executable, "-m", "app", "up", "--model", str(llama_dir)]
    command += ["--port", "0", "--kv-backend", "ray", "--router-args", "--local-prefill-tokens 0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    watchdog = threading.Timer(180.0, process.kill)  # a hang fails the test, it does not stay
    watchdog.start()
    try:
        assert process.stdout is not None
        address = ""
        for line in process.stdout:
            if "ready" in line and "router" in line:
                address = line.split("router ")[1].split(",")[0]
                break
        assert address, f"pdserve up exited with {process.wait()} before ready"
        sampling = common_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        request = router_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=sampling)
        [result] = run(generate_many(address, [request]))
        assert result.completion_tokens == 4 and result.transfer_s > 0
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        watchdog.cancel()
        if process.poll() is None:
            process.kill()
