"""The decode GEMM alone, at a model's own shapes: GB/s of weights moved by each of pdserve's
small-M kernels for a dtype (native_engine/kernels/small_gemm.py; bf16 or fp32) and by
oneDNN's packed path in that dtype (what the engine used before, and still uses above the
switch point), against this box's copy bandwidth measured in the same run.

Weights are read from memory, not from cache: each shape is timed over distinct copies that
together exceed the last-level cache several times, as a decode step reads each weight once.
Prints a table per M (each kernel's GB/s over the model's GEMMs, and as a share of the copy
bandwidth), the M from which oneDNN is faster (the switch point the engine's table holds),
then one JSON line.

    .venv/bin/python benchmarks/small_gemm.py [--rows 1,8,32,64,256] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_inputs import REPO
from memory_limit import copy_gb_s, gemm_shapes, last_level_cache_bytes  # sibling module

from app.fetch_model import fetch_model
from native_engine.kernels import small_gemm
from native_engine.models.linear import onednn_packs

ONEDNN = "onednn"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="default: the real SmolLM2")
    p.add_argument("--rows", default="1,8,32,64,256", help="M values")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--quick", action="store_true", help="CI: small shapes, M 1 and 8, 64 MiB")
    p.add_argument(
        "--kernels",
        default=None,
        help="a subset, say AMX,oneDNN (prefill-sized M: the others take minutes a shape)",
    )
    return p.parse_args()


def kernels(
    dtype: torch.dtype,
) -> dict[str, Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]]:
    """name -> pack(weight) -> (x -> y), for every kernel this CPU runs in ``dtype``."""
    made: dict[str, Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]] = {}
    for isa in small_gemm.available(dtype):

        def ours(w: torch.Tensor, isa: small_gemm.GemmIsa = isa) -> Callable[..., torch.Tensor]:
            packed, k = small_gemm.pack(w), w.shape[1]
            return lambda x: small_gemm.gemm(x, packed, None, k, isa)

        made[isa.name] = ours
    if onednn_packs(dtype):

        def onednn(w: torch.Tensor) -> Callable[..., torch.Tensor]:
            packed = torch.ops.mkldnn._reorder_linear_weight(w)
            return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

        made[ONEDNN] = onednn
    return made


def time_shape(
    n: int,
    k: int,
    rows: list[int],
    total_bytes: int,
    repeats: int,
    only: set[str] | None,
    dtype: torch.dtype,
) -> dict[str, dict[int, float]]:
    """Seconds per call of each kernel (``only`` those) at each M, the weights cold (copies
    cycled)."""
    copies = max(2, total_bytes // (n * k * dtype.itemsize))
    base = (torch.randn(n, k) * 0.05).to(dtype)
    seconds: dict[str, dict[int, float]] = {}
    for name, make in kernels(dtype).items():
        if only is not None and name not in only:
            continue
        calls = [make(base) for _ in range(copies)]
        seconds[name] = {}
        for m in rows:
            x = torch.randn(m, k).to(dtype)
            calls[0](x)  # first call: thread pool, tile configuration
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                for call in calls:
                    call(x)
                best = min(best, (time.perf_counter() - start) / copies)
            seconds[name][m] = best
        del calls
    return seconds


def main() -> None:
    args = parse_args()
    if args.quick:
        shapes = {"small": (256, 128), "wide": (1024, 256)}
        rows, total = [1, 8], 64 << 20
    else:
        model, _ = fetch_model("smollm2", args.model or REPO / "models" / "smollm2-135m-instruct")
        shapes = gemm_shapes(model)
        rows, total = [int(m) for m in args.rows.split(",")], 4 * last_level_cache_bytes()
    stream = copy_gb_s(size_bytes=total if args.quick else None)
    dtype = getattr(torch, args.dtype)
    size = dtype.itemsize
    chosen = small_gemm.chosen(dtype)
    only = set(args.kernels.split(",")) if args.kernels else None
    per_shape = {
        s: time_shape(n, k, rows, total, args.repeats, only, dtype) for s, (n, k) in shapes.items()
    }
    names = list(next(iter(per_shape.values())))
    layer_bytes = {s: n * k * size for s, (n, k) in shapes.items()}
    name = chosen.name if chosen is not None else None
    print(
        f"{args.dtype} GEMM, weights from memory; copy bandwidth {stream:.1f} GB/s; chosen: {name}"
    )
    print(f"{'M':>4} " + " ".join(f"{name:>18}" for name in names))
    table: list[dict[str, Any]] = []
    for m in rows:
        # The model's GEMMs in one step's proportions: bytes over summed times.
        gb_s = {
            name: sum(layer_bytes.values()) / sum(per_shape[s][name][m] for s in shapes) / 1e9
            for name in names
        }
        table.append(
            {"m": m, "gb_s": gb_s, "share_of_copy": {n: g / stream for n, g in gb_s.items()}}
        )
        print(
            f"{m:>4} " + " ".join(f"{gb_s[n]:>8.1f} GB/s {gb_s[n] / stream:>4.0%}" for n in names)
        )
    switch = None
    if chosen is not None and ONEDNN in names:
        faster = [r["m"] for r in table if r["gb_s"][ONEDNN] > r["gb_s"][chosen.name]]
        switch = min(faster) if faster else None
        print(f"oneDNN is faster than {chosen.name} from M = {switch} (of those measured)")
    shapes_out = [
        {
            "shape": s,
            "n": n,
            "k": k,
            "gb_s": {
                name: {m: n * k * size / per_shape[s][name][m] / 1e9 for m in rows}
                for name in names
            },
        }
        for s, (n, k) in shapes.items()
    ]
    report = {
        "benchmark": "small_gemm",
        "dtype": args.dtype,
        "copy_gb_s": stream,
        "chosen": chosen.name if chosen is not None else None,
        "kernels": names,
        "model": table,
        "shapes": shapes_out,
        "onednn_faster_from_m": switch,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
