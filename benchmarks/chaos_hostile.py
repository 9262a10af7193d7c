"""The chaos benchmark's hostile scenarios (``chaos.py`` runs them beside
``chaos_scenarios.py``'s faults): clients written to break the cluster while the load runs.

- ``hostile-http``: slowloris heads, trickled bodies and 1 MB heads on the HTTP port.
- ``hostile-requests``: requests written to break a worker or a client (docs/security.md,
  "Hostile requests") and silent sockets, mixed into the load.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from chaos_scenarios import Fault, Schedule  # sibling module

from app.embedded_redis import EmbeddedRedis
from app.local_cluster import LocalCluster


def hostile_http(
    cluster: LocalCluster, redis: EmbeddedRedis, stall_s: float, duration_s: float, seed: int
) -> Schedule:
    """While the load runs (gRPC), the router's HTTP port gets 100 slowloris heads (a byte a
    second), 10 trickled bodies and 10 heads of 1 MB: each must be refused (408 / 431) within
    its bound (--request-header-timeout-s 10, --request-body-timeout-s 30), and the load must
    not notice. Reported per kind: how many were refused, and after how long the last was."""
    host, _, port = cluster.http_url.removeprefix("http://").rpartition(":")
    kinds = ["head"] * 100 + ["body"] * 10 + ["huge"] * 10
    with ThreadPoolExecutor(len(kinds)) as pool:
        replies = list(pool.map(lambda kind: _hostile(host, int(port), kind), kinds))
    schedule = Schedule()
    for kind in ("head", "body", "huge"):
        mine = [r for k, r in zip(kinds, replies, strict=True) if k == kind]
        refused = sum(status in (b"408", b"431") for status, _ in mine)
        slowest = max(elapsed_s for _, elapsed_s in mine)
        schedule.faults.append(Fault(f"{refused}/{len(mine)} {kind} refused, last", slowest))
    return schedule


def _hostile(host: str, port: int, kind: str) -> tuple[bytes, float]:
    """One hostile connection: its reply's status code (b"" if none) and when it came."""
    start = time.monotonic()
    with socket.create_connection((host, port), timeout=60) as sock:
        if kind == "huge":
            pieces = [b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (1 << 20)]
        elif kind == "body":
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
            pieces = [head] + [b" "] * 90
        else:
            pieces = [b"GET /health HTTP/1.1\r\n"] + [b"X"] * 90
        sock.settimeout(1.0)
        reply = b""
        for piece in pieces:
            try:
                sock.sendall(piece)
                reply += sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                break
            if reply:
                break
        sock.settimeout(10.0)
        try:
            while not reply.count(b" ") and (more := sock.recv(4096)):
                reply += more
        except OSError:
            pass
    return reply.split(b" ")[1] if reply.startswith(b"HTTP/1.1 ") else b"", time.monotonic() - start


# Requests written to break a worker or a client (docs/security.md, "Hostile requests"), as
# OpenAI bodies, with what each must get: a named 400, or 200 with strict JSON.
_PROMPT = "the quick brown fox jumps over the lazy dog " * 6
HOSTILE_BODIES: list[tuple[str, str, dict[str, Any], int]] = [
    (
        "grammar banned at 0",
        "/v1/completions",
        {"prompt": _PROMPT, "guided_regex": "7", "bad_words": ["7"], "max_tokens": 4},
        400,
    ),
    (
        "grammar banned at 1",
        "/v1/completions",
        {"prompt": _PROMPT, "guided_regex": "78", "bad_words": ["78"], "max_tokens": 4},
        400,
    ),
    (
        "bias id past vocab",
        "/v1/completions",
        {"prompt": _PROMPT, "logit_bias": {"70000": 1.0}, "max_tokens": 4},
        400,
    ),
    (
        "control text in role",
        "/v1/chat/completions",
        {"messages": [{"role": "user<|eos|>", "content": "hi"}], "max_tokens": 4},
        400,
    ),
    (
        "unknown role",
        "/v1/chat/completions",
        {"messages": [{"role": "sudo", "content": "hi"}], "max_tokens": 4},
        400,
    ),
    (
        "echo bomb",
        "/v1/completions",
        {
            "prompt": list(range(3, 483)),
            "n": 8,
            "max_tokens": 2,
            "echo": True,
            "logprobs": 5,
            "prompt_logprobs": 20,
            "temperature": 0.0,
        },
        200,
    ),
    (
        "guided top_logprobs",
        "/v1/completions",
        {"prompt": _PROMPT, "guided_choice": ["yes", "no"], "logprobs": 20, "max_tokens": 3},
        200,
    ),
]


def hostile_requests(
    cluster: LocalCluster, redis: EmbeddedRedis, stall_s: float, duration_s: float, seed: int
) -> Schedule:
    """While the load runs, rounds of ``HOSTILE_BODIES`` (each must get its named 400, or a
    200 that parses as strict JSON) and 300 silent sockets on the HTTP port, with the router's
    /health probed every 50 ms. Reported: how many hostile requests got what they must, the
    /health p99, and the workers lost (dead or restarted: goal 0)."""
    rng = random.Random(seed)
    pids = {c.name: c.process.pid for c in cluster.components}
    host, _, port = cluster.http_url.removeprefix("http://").rpartition(":")
    stop = threading.Event()
    health: list[float] = []

    def probe() -> None:
        while not stop.is_set():
            start = time.monotonic()
            with urllib.request.urlopen(f"{cluster.http_url}/health", timeout=30) as r:
                r.read()
            health.append(time.monotonic() - start)
            stop.wait(0.05)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    silent = [socket.create_connection((host, int(port))) for _ in range(300)]
    ok = sent = 0
    missed: set[str] = set()
    end = time.monotonic() + duration_s * 0.8
    try:
        while time.monotonic() < end:
            for name, path, body, status in rng.sample(HOSTILE_BODIES, len(HOSTILE_BODIES)):
                sent += 1
                if _answers(cluster.http_url + path, body, status):
                    ok += 1
                else:
                    missed.add(name)
    finally:
        stop.set()
        prober.join()
        for sock in silent:
            sock.close()
    lost = sum(
        c.process.poll() is not None or pids.get(c.name) != c.process.pid
        for c in cluster.components
    )
    health.sort()
    p99 = health[min(len(health) - 1, int(len(health) * 0.99))] if health else None
    schedule = Schedule()
    wrong = f" (wrong: {', '.join(sorted(missed))})" if missed else ""
    answered = f"{ok}/{sent} hostile requests answered as they must{wrong}"
    schedule.faults.append(Fault(answered, timed=False))
    schedule.faults.append(Fault(f"/health p99 over {len(health)} probes", p99))
    schedule.faults.append(Fault(f"{lost} workers lost (dead or restarted)", timed=False))
    return schedule


def _answers(url: str, body: dict[str, Any], status: int) -> bool:
    """Whether ``body`` gets ``status``, in strict JSON (no NaN, no Infinity)."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            got, text = r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        got, text = exc.code, exc.read().decode()
    try:
        json.loads(text, parse_constant=_refuse_constant)
    except ValueError:
        return False
    return bool(got == status)


def _refuse_constant(constant: str) -> None:
    raise ValueError(f"non-strict JSON: {constant}")


SCENARIOS = {"hostile-http": hostile_http, "hostile-requests": hostile_requests}
