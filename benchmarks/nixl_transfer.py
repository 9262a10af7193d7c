"""The NIXL rows of ``benchmarks/kv_transfer.py``: the same blocks as the gRPC rows (scattered
on the sender: reversed block ids), served by a child process's ``NixlKVSender`` and read by
this process's ``NixlKVReceiver`` straight into its cache, with verification off and on
(interleaved, medians), bytes checked once. As in serving, the sender records the digests of
the verified pulls' handles before they are pulled (``NixlKVSender.handle``). The transport
UCX chose for the READ is read from a probe child's ``UCX_PROTO_INFO`` table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from native_engine.kv_cache import KVCache

MIB = 1 << 20


def available() -> bool:
    try:
        import nixl_cu12  # noqa: F401
    except ImportError:
        return False
    return True


def verified_tags(repeats: int) -> list[str]:
    """The request ids of the pulls made with verification on."""
    return ["warm-up", "probe"] + [f"on-{i}" for i in range(repeats)]


async def serve(num_blocks: int, repeats: int) -> None:
    """The sender child: issues the verified pulls' handles (their digests recorded, as a
    prefill worker does), prints its control address, serves until stdin closes."""
    from bench_inputs import FixedLeases
    from kv_transfer import LAYOUT, filled_cache, sender_block_ids

    from kvtransfer.nixl_sender import NixlKVSender

    cache = filled_cache(num_blocks)
    assert cache.layout == LAYOUT
    sender = NixlKVSender(cache, FixedLeases(sender_block_ids(num_blocks)), max_pull_s=600.0)
    await sender.start()
    for tag in verified_tags(repeats):
        sender.handle(tag, num_blocks, 600.0, "", b"")
    await asyncio.gather(*sender.recorded_digests())
    print(sender.address, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await sender.stop()


async def _pull(receiver: Any, address: str, num_blocks: int, tag: str) -> float:
    from kv_transfer import LAYOUT

    from kvtransfer.base import KVHandle

    handle = KVHandle("nixl", address, tag, num_blocks, LAYOUT, 600.0)
    start = time.perf_counter()
    stats = await receiver.pull(handle, list(range(num_blocks)))
    elapsed = time.perf_counter() - start
    if stats.num_bytes != num_blocks * LAYOUT.block_bytes:
        raise RuntimeError(f"pulled {stats.num_bytes} bytes")
    return elapsed


async def probe(address: str, num_blocks: int) -> None:
    """The probe child: one verified pull (its UCX protocol table goes to stderr)."""
    from kv_transfer import LAYOUT

    from kvtransfer.nixl_receiver import NixlKVReceiver

    receiver = NixlKVReceiver(KVCache(LAYOUT, num_blocks, torch.device("cpu")))
    try:
        await _pull(receiver, address, num_blocks, "probe")
    finally:
        await receiver.close()


def ucx_transports(address: str, num_blocks: int) -> list[str]:
    """What UCX used for the READ ("cma/memory", "tcp/lo", ...), from its protocol table."""
    command = [sys.executable, str(Path(__file__).resolve()), "--probe", address]
    command += ["--num-blocks", str(num_blocks)]
    env = {**os.environ, "UCX_PROTO_INFO": "y"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    lines = (done.stdout + done.stderr).splitlines()
    found: list[str] = []
    for i, line in enumerate(lines):
        if "remote memory read" not in line:
            continue
        for row in lines[i + 1 : i + 8]:  # the table under the heading: | range | how | config |
            match = re.search(r"\|\s*[\d.]+\.\.\w+\s*\|[^|]*\|\s*([\w/.-]+)\s*\|", row)
            if match and match.group(1) not in found:
                found.append(match.group(1))
    return found or ["unknown"]


async def _measure(
    address: str, num_blocks: int, repeats: int, sent: torch.Tensor
) -> dict[str, Any]:
    from kv_transfer import LAYOUT

    from kvtransfer.nixl_receiver import NixlKVReceiver

    cache = KVCache(LAYOUT, num_blocks, torch.device("cpu"))
    plain = NixlKVReceiver(cache, verify=False)
    checked = NixlKVReceiver(cache, verify=True)
    off: list[float] = []
    on: list[float] = []
    try:
        cache.tensor.zero_()
        await _pull(checked, address, num_blocks, "warm-up")  # handshakes, first READ
        verified = torch.equal(cache.tensor, sent)
        await _pull(plain, address, num_blocks, "warm-up-2")
        for i in range(repeats):  # interleaved: drift hits both alike
            cache.tensor.zero_()
            off.append(await _pull(plain, address, num_blocks, f"off-{i}"))
            on.append(await _pull(checked, address, num_blocks, f"on-{i}"))
        verified = verified and torch.equal(cache.tensor, sent)
    finally:
        await plain.close()
        await checked.close()
    return {"nixl_s": off, "nixl_verify_s": on, "verified": verified}


def measure_nixl(
    args: argparse.Namespace, num_blocks: int, raw_gb_s: float, grpc_gb_s: float
) -> dict[str, Any]:
    from kv_transfer import LAYOUT, filled_cache, sender_block_ids, spawn_child, stop_child

    num_bytes = num_blocks * LAYOUT.block_bytes
    sent = filled_cache(num_blocks).tensor[:, :, sender_block_ids(num_blocks)]
    sender, address = spawn_child("--serve-nixl", args)
    try:
        rows = asyncio.run(_measure(address, num_blocks, args.repeats, sent))
        transports = ucx_transports(address, num_blocks)
    finally:
        stop_child(sender)
    off_gb_s = num_bytes / statistics.median(rows["nixl_s"]) / 1e9
    on_gb_s = num_bytes / statistics.median(rows["nixl_verify_s"]) / 1e9
    return {
        **rows,
        "bytes": num_bytes,
        "repeats": args.repeats,
        "nixl_gb_s": off_gb_s,
        "nixl_verify_gb_s": on_gb_s,
        "nixl_over_raw": off_gb_s / raw_gb_s,
        "nixl_over_grpc": off_gb_s / grpc_gb_s,
        "verify_cost": 1 - on_gb_s / off_gb_s,
        "ucx_transports": transports,
        "ucx_tls": os.environ.get("UCX_TLS", "(UCX default)"),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--probe", required=True)
    parser.add_argument("--num-blocks", type=int, required=True)
    options = parser.parse_args()
    asyncio.run(probe(options.probe, options.num_blocks))
