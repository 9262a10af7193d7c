"""KV transfer: gRPC streaming and NIXL vs raw loopback TCP, Ray object store vs raw Ray, TTFT.

Part 1, transport. A child process (this file, ``--serve-sender``) fills a ``KVCache`` with
seeded random float32 data and serves it through ``GrpcKVSender``; the parent pulls ``--mib``
MiB of blocks with ``GrpcKVReceiver`` into its own cache (synthetic layout, 1 MiB per block), and
checks once that the bytes match. The baseline moves the same bytes over a plain loopback TCP
socket from a second child (``--serve-raw``: ``sendall`` of a preallocated buffer; the parent
``recv_into`` a preallocated buffer, one connection reused). One warm-up, then ``--repeats``
timed runs of each, interleaved; medians. Goal: gRPC >= 0.5x raw TCP. The NIXL rows
(``benchmarks/nixl_transfer.py``): the same blocks read by one-sided NIXL READs from a third
child (``--serve-nixl``), verification off and on. Goal: NIXL >= 0.8x raw TCP and >= 5x gRPC
(verification off). Then the Ray rows
(``benchmarks/ray_transfer.py``): the Ray backend between two actors vs raw ``ray.put`` +
``ray.get`` of the same bytes. Goal: Ray backend >= 0.8x raw Ray.

Part 2, TTFT split for a long prompt (2048 tokens on the ``small`` model, or the largest that
fits its ``max_position_embeddings``). First the prefill compute alone (in-process ``LLM``,
``max_tokens=1``), then a local cluster (router + 1 prefill + 1 decode) serving sequential
requests with fresh random prompts (no prefix-cache hits): TTFT, the router's prefill call
(``prefill_s``), queueing and overhead (``prefill_s - compute``), and ``transfer_s`` (decode
admission + KV pull). The router streams the first token straight from the prefill response, so
the transfer runs after the first token and delays only the second. Goal: transfer <= 0.10 TTFT.
The split runs for the gRPC backend and, when NIXL is installed, for the NIXL one.

Ends with a single JSON line holding every number. ``--quick`` is a short smoke run (tiny model,
short prompt, smaller transfers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import torch
from bench_inputs import FixedLeases  # sibling modules: on sys.path
from nixl_transfer import available as nixl_available
from nixl_transfer import measure_nixl, serve
from ray_transfer import RAY_GOAL, measure_ray
from ttft_split import measure_ttft

from kvtransfer.base import KVHandle
from kvtransfer.codec import DEFAULT_CHUNK_BYTES
from kvtransfer.grpc_stream import GrpcKVReceiver, GrpcKVSender
from native_engine.kv_cache import KVCache, KVCacheLayout

REPO = Path(__file__).resolve().parents[1]
MIB = 1 << 20
BLOCK_SIZE = 16
# float32, 2 (k|v) * 8 layers * 16 tokens * 8 heads * 128 dims * 4 bytes = 1 MiB per block.
LAYOUT = KVCacheLayout(
    "bench", "float32", block_size=BLOCK_SIZE, num_layers=8, num_kv_heads=8, head_dim=128
)
FILL_SEED = 1234
GRPC_GOAL = 0.5  # gRPC throughput / raw TCP throughput, at least
TRANSFER_GOAL = 0.10  # transfer_s / ttft_s, at most
NIXL_GOALS = (0.8, 5.0)  # NIXL throughput / raw TCP, / gRPC, at least (verification off)
FULL = {"mib": 64.0, "repeats": 7, "size": "small", "prompt_len": 2048, "ttft_repeats": 3}
QUICK = {"mib": 16.0, "repeats": 2, "size": "tiny", "prompt_len": 128, "ttft_repeats": 2}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--mib", type=float, help="MiB moved per transfer (default 64)")
    p.add_argument("--repeats", type=int, help="timed transfers of each kind, median kept (5)")
    p.add_argument(
        "--chunk-mib",
        type=float,
        default=DEFAULT_CHUNK_BYTES / MIB,
        help=f"GrpcKVSender chunk size in MiB (default {DEFAULT_CHUNK_BYTES / MIB:g})",
    )
    p.add_argument("--skip-ttft", action="store_true", help="transport only (no model, cluster)")
    p.add_argument("--skip-ray", action="store_true", help="no Ray rows (no local Ray)")
    p.add_argument("--skip-nixl", action="store_true", help="no NIXL rows")
    p.add_argument("--size", choices=("tiny", "small"), help="checkpoint size (default small)")
    p.add_argument("--model", type=Path, help="HF checkpoint dir (default models/bench-llama-*)")
    p.add_argument("--prompt-len", type=int, help="TTFT prompt tokens (default 2048)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per TTFT request (8)")
    p.add_argument("--ttft-repeats", type=int, help="timed TTFT requests after 1 warm-up (3)")
    p.add_argument("--quick", action="store_true", help="tiny model, short prompt (CI smoke)")
    # Internal: the child processes of part 1.
    p.add_argument("--serve-sender", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--serve-raw", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--serve-nixl", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.repeats < 1 or args.ttft_repeats < 1 or args.prompt_len < 1 or args.max_tokens < 2:
        p.error("need --repeats, --ttft-repeats, --prompt-len >= 1 and --max-tokens >= 2")
    if args.mib < LAYOUT.block_bytes / MIB or args.chunk_mib <= 0:
        p.error(f"need --mib >= {LAYOUT.block_bytes / MIB:g} (one block) and --chunk-mib > 0")
    return args


def num_blocks_for(mib: float) -> int:
    return max(1, round(mib * MIB / LAYOUT.block_bytes))


def sender_block_ids(num_blocks: int) -> list[int]:
    """Reversed, so the sender gathers non-contiguous rows like a real paged cache would."""
    return list(range(num_blocks - 1, -1, -1))


def filled_cache(num_blocks: int) -> KVCache:
    cache = KVCache(LAYOUT, num_blocks, torch.device("cpu"))
    cache.tensor.normal_(generator=torch.Generator().manual_seed(FILL_SEED))
    return cache


# ---------------------------------------------------------------- part 1: child processes


async def serve_sender(num_blocks: int, chunk_bytes: int) -> None:
    """Prints the sender address, then serves until stdin closes."""
    cache = filled_cache(num_blocks)
    sender = GrpcKVSender(cache, FixedLeases(sender_block_ids(num_blocks)), chunk_bytes=chunk_bytes)
    await sender.start()
    print(sender.address, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await sender.stop()


def serve_raw(num_bytes: int) -> None:
    """Prints the port; for each 1-byte request on the one connection, sends ``num_bytes``."""
    payload = memoryview(bytearray(b"\xa5" * num_bytes))
    with socket.create_server(("127.0.0.1", 0)) as server:
        print(f"127.0.0.1:{server.getsockname()[1]}", flush=True)
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while conn.recv(1):
                conn.sendall(payload)


def start_child(mode: str, args: argparse.Namespace) -> subprocess.Popen[str]:
    """This file in ``mode`` (its address comes with ``child_address``)."""
    command = [sys.executable, str(Path(__file__).resolve()), mode]
    command += ["--mib", str(args.mib), "--chunk-mib", str(args.chunk_mib)]
    command += ["--repeats", str(args.repeats)]
    return subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO
    )


def child_address(process: subprocess.Popen[str], mode: str) -> str:
    """The address a child printed once it listens."""
    assert process.stdout is not None
    address = process.stdout.readline().strip()
    if not address:
        raise RuntimeError(f"{mode} child exited with {process.wait()} before its address")
    return address


def spawn_child(mode: str, args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    """This file in ``mode``; returns the process and the address it printed."""
    process = start_child(mode, args)
    return process, child_address(process, mode)


def stop_child(process: subprocess.Popen[str]) -> None:
    stdin: IO[str] | None = process.stdin
    if stdin is not None:
        stdin.close()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# ---------------------------------------------------------------- part 1: the parent side


def raw_pull(sock: socket.socket, buffer: memoryview) -> float:
    start = time.perf_counter()
    sock.sendall(b"x")
    got = 0
    while got < len(buffer):
        n = sock.recv_into(buffer[got:])
        if n == 0:
            raise RuntimeError(f"raw TCP sender closed after {got} of {len(buffer)} bytes")
        got += n
    return time.perf_counter() - start


async def measure_transport(args: argparse.Namespace) -> dict[str, Any]:
    num_blocks = num_blocks_for(args.mib)
    num_bytes = num_blocks * LAYOUT.block_bytes
    chunk_bytes = int(args.chunk_mib * MIB)
    # The data the sender serves, regenerated here to check what arrives.
    sent = filled_cache(num_blocks).tensor[:, :, sender_block_ids(num_blocks)]
    cache = KVCache(LAYOUT, num_blocks, torch.device("cpu"))
    receiver = GrpcKVReceiver(cache)
    block_ids = list(range(num_blocks))
    # Both start at once: each child's imports take seconds.
    sender, raw = start_child("--serve-sender", args), start_child("--serve-raw", args)
    grpc_s: list[float] = []
    grpc_pull_s: list[float] = []
    raw_s: list[float] = []
    try:
        sender_address = child_address(sender, "--serve-sender")
        raw_address = child_address(raw, "--serve-raw")
        host, port = raw_address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        raw_buffer = memoryview(bytearray(num_bytes))

        async def grpc_pull(i: int) -> tuple[float, float]:
            cache.tensor.zero_()  # outside the timing; a stale cache cannot pass the check
            handle = KVHandle("grpc", sender_address, f"bench-{i}", num_blocks, LAYOUT, 30.0)
            start = time.perf_counter()
            stats = await receiver.pull(handle, block_ids)
            elapsed = time.perf_counter() - start
            if stats.num_bytes != num_bytes:
                raise RuntimeError(f"pulled {stats.num_bytes} bytes, expected {num_bytes}")
            return elapsed, stats.duration_s

        with sock:
            await grpc_pull(-1)  # warm-up: channel, connection, first allocations
            verified = torch.equal(cache.tensor, sent)
            if not verified:
                raise RuntimeError("gRPC transfer delivered different bytes than the sender's")
            raw_pull(sock, raw_buffer)
            if raw_buffer[-1] != 0xA5:
                raise RuntimeError("raw TCP transfer delivered wrong bytes")
            for i in range(args.repeats):  # interleaved: load drift hits both alike
                elapsed, pull_s = await grpc_pull(i)
                grpc_s.append(elapsed)
                grpc_pull_s.append(pull_s)
                raw_s.append(raw_pull(sock, raw_buffer))
            verified = verified and torch.equal(cache.tensor, sent)
    finally:
        await receiver.close()
        stop_child(sender)
        stop_child(raw)
    grpc_med, raw_med = statistics.median(grpc_s), statistics.median(raw_s)
    return {
        "bytes": num_bytes,
        "mib": num_bytes / MIB,
        "num_blocks": num_blocks,
        "block_bytes": LAYOUT.block_bytes,
        "chunk_bytes": chunk_bytes,
        "repeats": args.repeats,
        "verified": verified,
        "grpc_s": grpc_s,
        "grpc_pull_stats_s": grpc_pull_s,
        "raw_tcp_s": raw_s,
        "grpc_gb_s": num_bytes / grpc_med / 1e9,
        "raw_tcp_gb_s": num_bytes / raw_med / 1e9,
        "grpc_over_raw": raw_med / grpc_med,
        "goal_grpc_over_raw": GRPC_GOAL,
    }


# ---------------------------------------------------------------- part 2: TTFT split


def print_table(report: dict[str, Any]) -> None:
    t = report["transport"]
    print(
        f"\ntransport: {t['mib']:g} MiB ({t['num_blocks']} blocks of "
        f"{t['block_bytes'] / MIB:g} MiB), chunks of {t['chunk_bytes'] / MIB:g} MiB, "
        f"loopback, median of {t['repeats']}; bytes verified: {t['verified']}"
    )
    header = f"{'path':<22} {'median ms':>10} {'GB/s':>7} {'vs raw':>7}"
    print(header)
    print("-" * len(header))
    for name, key, gb_s in (
        ("gRPC stream (pdserve)", "grpc_s", t["grpc_gb_s"]),
        ("raw TCP socket", "raw_tcp_s", t["raw_tcp_gb_s"]),
    ):
        ms = 1e3 * statistics.median(t[key])
        print(f"{name:<22} {ms:>10.1f} {gb_s:>7.3f} {gb_s / t['raw_tcp_gb_s']:>6.2f}x")
    verdict = "ok" if t["grpc_over_raw"] >= GRPC_GOAL else "BELOW GOAL"
    print(f"gRPC / raw = {t['grpc_over_raw']:.2f} (goal >= {GRPC_GOAL}): {verdict}")
    n = report.get("nixl")
    if n is not None:
        print(
            f"\nNIXL READ, same blocks; UCX: {', '.join(n['ucx_transports'])}; "
            f"bytes verified: {n['verified']}"
        )
        for name, key, gb_s in (
            ("NIXL (pdserve)", "nixl_s", n["nixl_gb_s"]),
            ("NIXL, --kv-verify on", "nixl_verify_s", n["nixl_verify_gb_s"]),
        ):
            ms = 1e3 * statistics.median(n[key])
            print(f"{name:<22} {ms:>10.1f} {gb_s:>7.3f} {gb_s / t['raw_tcp_gb_s']:>6.2f}x")
        met = n["nixl_over_raw"] >= NIXL_GOALS[0] and n["nixl_over_grpc"] >= NIXL_GOALS[1]
        print(
            f"NIXL / raw = {n['nixl_over_raw']:.2f}, / gRPC = {n['nixl_over_grpc']:.2f} (goals >= "
            f"{NIXL_GOALS[0]}, >= {NIXL_GOALS[1]}): {'ok' if met else 'BELOW GOAL'}; verification "
            f"costs {n['verify_cost']:.0%}"
        )
    r = report.get("ray")
    if r is not None:
        print(f"\nRay, same bytes, between two actors; bytes verified: {r['verified']}")
        print(header.replace("raw", "put+get"))
        print("-" * len(header))
        for name, key, gb_s in (
            ("Ray backend (pdserve)", "ray_s", r["ray_gb_s"]),
            ("raw ray.put + ray.get", "raw_ray_s", r["raw_ray_gb_s"]),
            ("  + copy into dest.", "raw_ray_copy_s", r["raw_ray_copy_gb_s"]),
        ):
            ms = 1e3 * statistics.median(r[key])
            print(f"{name:<22} {ms:>10.1f} {gb_s:>7.3f} {gb_s / r['raw_ray_gb_s']:>6.2f}x")
        verdict = "ok" if r["ray_over_raw"] >= RAY_GOAL else "BELOW GOAL"
        print(
            f"Ray backend / raw put+get = {r['ray_over_raw']:.2f} (goal >= {RAY_GOAL}): {verdict}"
        )
    for key in ("ttft", "ttft_nixl"):
        print_ttft(key, report.get(key))


def print_ttft(key: str, s: dict[str, Any] | None) -> None:
    if s is None:
        print(f"\n{key}: skipped\n")
        return
    print(
        f"\nTTFT split ({s['backend']}): {s['model']}, {s['prompt_tokens']}-token prompts "
        f"({s['kv_bytes'] / MIB:g} MiB of KV), {s['max_tokens']} tokens, greedy, "
        f"median of {s['repeats']}"
    )
    if s["note"]:
        print(f"  note: {s['note']}")
    rows = (
        ("TTFT (router)", s["ttft_s"]),
        ("  prefill call (router)", s["prefill_s"]),
        ("    prefill compute", s["compute_s"]),
        ("    queueing + overhead", s["overhead_s"]),
        ("KV transfer (after tok 1)", s["transfer_s"]),
        ("TPOT", s["tpot_s"]),
    )
    for name, seconds in rows:
        share = f"{seconds / s['ttft_s']:>6.1%}" if s["ttft_s"] > 0 else ""
        print(f"{name:<26} {1e3 * seconds:>9.1f} ms {share}")
    verdict = "ok" if s["transfer_over_ttft"] <= TRANSFER_GOAL else "ABOVE GOAL"
    print(
        f"transfer / TTFT = {s['transfer_over_ttft']:.3f} (goal <= {TRANSFER_GOAL}): {verdict}; "
        "the transfer delays token 2, not token 1\n"
    )


_NIXL_KEYS = ("nixl_gb_s", "nixl_verify_gb_s", "nixl_over_raw", "nixl_over_grpc", "ucx_transports")


def main() -> None:
    args = parse_args()
    if args.serve_sender:
        asyncio.run(serve_sender(num_blocks_for(args.mib), int(args.chunk_mib * MIB)))
        return
    if args.serve_raw:
        serve_raw(num_blocks_for(args.mib) * LAYOUT.block_bytes)
        return
    if args.serve_nixl:
        asyncio.run(serve(num_blocks_for(args.mib), args.repeats))
        return
    started = time.perf_counter()
    print(f"transport: {args.mib:g} MiB, gRPC stream vs raw TCP ...", flush=True)
    transport = asyncio.run(measure_transport(args))
    nixl = None
    if not args.skip_nixl and nixl_available():
        raw, grpc = transport["raw_tcp_gb_s"], transport["grpc_gb_s"]
        nixl = measure_nixl(args, num_blocks_for(args.mib), raw, grpc)
    ray_rows = None if args.skip_ray else measure_ray(args, num_blocks_for(args.mib))
    ttft = None if args.skip_ttft else measure_ttft(args)
    ttft_nixl = None if args.skip_ttft or nixl is None else measure_ttft(args, "nixl", ttft)
    report: dict[str, Any] = {
        "threads": torch.get_num_threads(),
        "grpc_over_raw": transport["grpc_over_raw"],
        **{k: nixl[k] if nixl else None for k in _NIXL_KEYS},
        "nixl": nixl,
        "ttft_nixl": ttft_nixl,
        "ray_over_raw": ray_rows["ray_over_raw"] if ray_rows else None,
        "ray": ray_rows,
        "transfer_over_ttft": ttft["transfer_over_ttft"] if ttft else None,
        "transport": transport,
        "ttft": ttft,
        "wall_s": time.perf_counter() - started,
    }
    print_table(report)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
