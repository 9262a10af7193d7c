"""The physical limit of decode on this box, measured in the benchmark's own run: a decode
step reads every weight once, so batch b cannot beat b x bandwidth / weight bytes tok/s.

The bandwidth is STREAM's copy: a buffer larger than the caches copied with every thread torch
runs, bytes read plus bytes written over the best time. Imported by the benchmarks, or run
alone to print it (and, given a model, its weight-read limit at batch 1).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from engine.model_config import ModelConfig


def last_level_cache_bytes() -> int:
    """The largest cache this CPU reports (sysfs), 64 MiB where it reports none."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=64 << 20)


def copy_gb_s(repeats: int = 5, size_bytes: int | None = None) -> float:
    """Copy bandwidth in GB/s (1e9 bytes): read + write, the best of ``repeats``, over a
    buffer four times the last-level cache (at least 1 GiB), or of ``size_bytes`` (a quick
    run's: a figure that may be the cache's, not memory's)."""
    size = size_bytes or max(1 << 30, 4 * last_level_cache_bytes())
    src = torch.ones(size // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults are not bandwidth
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * size / best / 1e9


def gemm_shapes(model: Path) -> dict[str, tuple[int, int]]:
    """(N, K) of each GEMM of one decoder layer (projections fused as the engine fuses them)
    and of the LM head."""
    c = ModelConfig.from_dir(model)
    return {
        "qkv": (c.q_size + 2 * c.kv_size, c.hidden_size),
        "o": (c.hidden_size, c.q_size),
        "gate_up": (2 * c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
        "lm_head": (c.vocab_size, c.hidden_size),
    }


def decode_weight_bytes(model: Path, bytes_per_weight: int) -> int:
    """What one decode step reads of the weights: every layer's GEMMs and the LM head (the
    embedding table only for the batch's rows: nothing, next to these)."""
    layers = ModelConfig.from_dir(model).num_layers
    shapes = gemm_shapes(model)
    head_n, head_k = shapes.pop("lm_head")
    per_layer = sum(n * k for n, k in shapes.values())
    return bytes_per_weight * (layers * per_layer + head_n * head_k)


def weight_read_limit_tok_s(weight_bytes: int, batch: int, gb_s: float) -> float:
    """Decode tok/s if a step took only the read of every weight once: batch x steps/s."""
    return batch * gb_s * 1e9 / weight_bytes


if __name__ == "__main__":
    gb_s = copy_gb_s()
    report: dict[str, object] = {"benchmark": "memory_limit", "copy_gb_s": gb_s}
    if len(sys.argv) > 1:  # a model directory: its bf16 weight-read limit at batch 1
        weight_bytes = decode_weight_bytes(Path(sys.argv[1]), 2)
        report["bf16_weight_bytes"] = weight_bytes
        report["bf16_limit_tok_s_b1"] = weight_read_limit_tok_s(weight_bytes, 1, gb_s)
    print(json.dumps(report))
