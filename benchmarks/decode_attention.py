"""Decode attention per layer call: the native C++ kernel vs the torch path (gather + SDPA).

Shapes are SmolLM2-135M's (9 query heads, 3 kv heads, head_dim 64, blocks of 16). Like a real
decode step, each call reads one layer's cache while the other layers' caches have pushed it
out of the CPU caches, and each sequence's blocks lie in a random order: the kernel is timed
cold, as the engine meets it. Prints a table and ratios (torch / kernel), then one JSON line.

    python benchmarks/decode_attention.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.dtypes import ModelDtype
from native_engine.attention import decode_gather_inputs, paged_decode_attention_torch
from native_engine.kernels.cpu import load_cpu_kernels, paged_decode_attention_cpu
from native_engine.kv_cache import LayerCache

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
DTYPES = (ModelDtype.FLOAT32, ModelDtype.BFLOAT16)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes (CI smoke)")
    p.add_argument("--layers", type=int, default=None, help="caches cycled through (30)")
    p.add_argument("--calls", type=int, default=None, help="timed calls per case (150)")
    args = p.parse_args()
    if args.layers is None:
        args.layers = 4 if args.quick else 30
    if args.calls is None:
        args.calls = 8 if args.quick else 150
    return args


def cases(quick: bool) -> list[tuple[str, int, int]]:
    if quick:
        return [("float32", 2, 40)]
    return [
        (dtype, batch, context)
        for dtype in (d.value for d in DTYPES)
        for batch, context in ((1, 290), (8, 290), (32, 290), (8, 1100), (1, 4096))
    ]


def time_calls(call: Callable[[int], torch.Tensor], layers: int, calls: int) -> float:
    """Median µs per call, cycling through the layers' caches."""
    for layer in range(layers):
        call(layer)  # warm-up: first-touch page faults, kernel build
    samples = []
    for i in range(calls):
        start = time.perf_counter()
        call(i % layers)
        samples.append(time.perf_counter() - start)
    samples.sort()
    return 1e6 * samples[len(samples) // 2]


def measure(dtype_name: str, batch: int, context: int, args: argparse.Namespace) -> dict[str, Any]:
    dtype = ModelDtype(dtype_name).as_torch
    gen = torch.Generator().manual_seed(batch * 7919 + context)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    caches = [
        LayerCache(torch.randn(shape, generator=gen).to(dtype), torch.randn(shape).to(dtype))
        for _ in range(args.layers)
    ]
    tables = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_seq).int()
    lens = torch.full((batch,), context, dtype=torch.int32)
    query = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, generator=gen).to(dtype)
    scale = HEAD_DIM**-0.5
    table, mask = decode_gather_inputs(tables, lens, context, BLOCK_SIZE)

    def kernel(layer: int) -> torch.Tensor:
        cache = caches[layer]
        return paged_decode_attention_cpu(query, cache.k, cache.v, tables, lens, scale)

    def torch_path(layer: int) -> torch.Tensor:
        return paged_decode_attention_torch(query, caches[layer], table, mask, scale)

    with torch.inference_mode():
        torch.testing.assert_close(kernel(0), torch_path(0), rtol=2e-2, atol=2e-2)
        kernel_us = time_calls(kernel, args.layers, args.calls)
        torch_us = time_calls(torch_path, args.layers, args.calls)
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * caches[0].k.element_size()
    return {
        "dtype": dtype_name,
        "batch": batch,
        "context": context,
        "kernel_us": round(kernel_us, 1),
        "torch_us": round(torch_us, 1),
        "torch_over_kernel": round(torch_us / kernel_us, 2),
        "kernel_gb_s": round(kv_bytes / kernel_us / 1e3, 2),
    }


def main() -> None:
    args = parse_args()
    if not load_cpu_kernels():
        raise SystemExit("the C++ kernel did not build: see the log above")
    rows = [measure(*case, args) for case in cases(args.quick)]
    print(f"decode attention per layer call, {torch.get_num_threads()} threads, cold caches")
    print(
        f"{'dtype':>9} {'batch':>5} {'ctx':>5} {'kernel µs':>10} {'torch µs':>9} "
        f"{'torch/kernel':>12} {'kernel GB/s':>11}"
    )
    for r in rows:
        print(
            f"{r['dtype']:>9} {r['batch']:>5} {r['context']:>5} {r['kernel_us']:>10.1f} "
            f"{r['torch_us']:>9.1f} {r['torch_over_kernel']:>11.2f}x {r['kernel_gb_s']:>11.2f}"
        )
    report = {"threads": torch.get_num_threads(), "layers": args.layers, "cases": rows}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
