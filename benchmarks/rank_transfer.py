"""A tensor-parallel engine's per-rank KV pull, over gRPC and over NIXL, in one run: a prefill
side of ``--prefill-tp`` ranks in a child process (a ``RankHub`` and one ``RankRuntime`` per
rank over vLLM-CPU-shaped pages, each rank's sender started through the hub), and this
process's decode side of ``--decode-tp`` ranks pulling the same blocks into its pages through
``RankKVReceiver`` (each rank reading the heads its shard holds: ``engine/kv_shards.py``).

The pages are a Llama-3-8B-like cache (32 layers, 8 KV heads of 128, block 32, bfloat16), split
over the ranks by heads. Each rank runs in a thread of its side's process (vLLM runs each in a
process of its own: the threads share a GIL, which weighs on gRPC's Python side more than on
NIXL's one-sided READs). Prints MB/s per pull (all ranks together, and per rank), the ratio
NIXL / gRPC, and one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from engine.kv_layout import KVCacheLayout
from kvtransfer import ReceiverOptions, SenderOptions
from kvtransfer.base import KVHandle
from vllm_engine.kv_pages import VllmKVPages
from vllm_engine.rank_hub import RankHub
from vllm_engine.rank_runtime import RankRuntime
from vllm_engine.rank_transfer import RankKVReceiver, RankKVSender

LAYERS, HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 32
BACKENDS = ("grpc", "nixl")


def layout(tp_size: int, tp_rank: int = 0) -> KVCacheLayout:
    return KVCacheLayout(
        "bench",
        "bfloat16",
        BLOCK,
        LAYERS,
        HEADS // tp_size,
        HEAD_DIM,
        page_layout="vllm-bench/CPU_ATTN/BHx32x256",
        tp_size=tp_size,
        tp_rank=tp_rank,
    )


def pages(tp_size: int, tp_rank: int, num_blocks: int, fill: bool) -> VllmKVPages:
    shape = (num_blocks, HEADS // tp_size, BLOCK, 2 * HEAD_DIM)
    make = torch.randn if fill else torch.zeros
    layers = [make(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    return VllmKVPages(layers, layout(tp_size, tp_rank), num_blocks)


async def side(tp_size: int, num_blocks: int, fill: bool) -> tuple[RankHub, list[RankRuntime]]:
    hub = RankHub(tp_size)
    await hub.start()
    ranks = [
        RankRuntime(pages(tp_size, r, num_blocks, fill), r, hub.address, hub.socket_dir)
        for r in range(tp_size)
    ]
    await asyncio.gather(*(asyncio.to_thread(rank.start) for rank in ranks))
    await hub.wait_ranks(60.0)
    return hub, ranks


async def serve(backend: str, tp_size: int, num_blocks: int) -> None:
    """The prefill child: its ranks' senders (one backend: a worker's), every request leasing
    the same blocks; prints the handle's address, serves until stdin closes."""
    from bench_inputs import FixedLeases

    hub, _ = await side(tp_size, num_blocks, fill=True)
    leases = FixedLeases(list(reversed(range(num_blocks))))  # scattered, as in serving
    sender = RankKVSender(hub, backend, leases, SenderOptions("127.0.0.1", 0, max_pull_s=600))
    await sender.start()
    print(sender.address, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


def prefill_child(args: argparse.Namespace, backend: str) -> tuple[subprocess.Popen[str], str]:
    command = [sys.executable, str(Path(__file__)), "--serve", backend]
    command += ["--prefill-tp", str(args.prefill_tp), "--num-blocks", str(args.num_blocks)]
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    return child, child.stdout.readline().strip()


async def pull(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    destination = list(range(args.num_blocks))
    results: dict[str, dict[str, float]] = {}
    for backend in BACKENDS:
        child, address = prefill_child(args, backend)
        hub, ranks = await side(args.decode_tp, args.num_blocks, fill=False)
        receiver = RankKVReceiver(hub, backend, ReceiverOptions(600.0))
        handle = KVHandle(backend, address, "r", args.num_blocks, layout(args.prefill_tp), 600.0)
        seconds, num_bytes = [], 0
        for i in range(args.repeats + 1):
            start = time.perf_counter()
            stats = await receiver.pull(handle, destination)
            if i:  # the first: connections, handshakes, registrations
                seconds.append(time.perf_counter() - start)
            num_bytes = stats.num_bytes
        for rank in ranks:
            await asyncio.to_thread(rank.close)
        await hub.close()
        child.kill()
        child.wait()
        median = statistics.median(seconds)
        results[backend] = {
            "bytes": num_bytes,
            "median_s": median,
            "mb_s": num_bytes / median / 1e6,
            "mb_s_per_rank": num_bytes / median / 1e6 / args.decode_tp,
        }
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--prefill-tp", type=int, default=2)
    p.add_argument("--decode-tp", type=int, default=2)
    p.add_argument("--num-blocks", type=int, default=64, help="32 tokens each")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--serve", choices=BACKENDS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve, args.prefill_tp, args.num_blocks))
        return
    results = asyncio.run(pull(args))
    ratio = results["nixl"]["mb_s"] / results["grpc"]["mb_s"]
    print(f"P TP={args.prefill_tp} -> D TP={args.decode_tp}, {args.num_blocks} blocks of {BLOCK}")
    for backend, r in results.items():
        print(
            f"  {backend:<5} {r['bytes'] / 1e6:8.1f} MB in {r['median_s'] * 1e3:7.1f} ms: "
            f"{r['mb_s']:8.0f} MB/s ({r['mb_s_per_rank']:.0f} per rank)"
        )
    print(f"  nixl / grpc: {ratio:.2f}x")
    out = {"benchmark": "rank_transfer", **vars(args), "results": results, "nixl_x_grpc": ratio}
    out.pop("serve")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
