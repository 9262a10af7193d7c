"""The end of a run: a table on stdout, ``results.json``, and PNG plots."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from app.bench.stats import Distribution, RequestRecord, Summary

PLOTS = ("latency_cdf.png", "latency_over_time.png", "phases.png")


def table(summary: Summary) -> str:
    s = summary
    lines = [
        f"requests: {s.num_completed} completed, {s.num_failed} failed in {s.duration_s:.2f} s",
        f"{'metric':<22}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    rows: tuple[tuple[str, Distribution], ...] = (
        ("TTFT (ms)", s.ttft_s),
        ("TPOT (ms)", s.tpot_s),
        ("inter-token (ms)", s.itl_s),
        ("end-to-end (ms)", s.e2e_s),
    )
    for name, d in rows:
        values = (d.mean, d.p50, d.p90, d.p99)
        lines.append(f"{name:<22}" + "".join(f"{1e3 * v:>10.1f}" for v in values))
    lines += [
        f"request throughput     {s.request_throughput:.2f} req/s",
        f"input token throughput {s.input_token_throughput:.1f} tok/s",
        f"output token throughput {s.output_token_throughput:.1f} tok/s",
    ]
    slos = ", ".join(
        f"{name} <= {1e3 * v:g} ms"
        for name, v in (("TTFT", s.slo_ttft_s), ("TPOT", s.slo_tpot_s))
        if v is not None
    )
    lines.append(
        f"goodput                {s.goodput:.2f} req/s ({s.slo_fraction:.1%} of requests within "
        f"{slos or 'no SLO'})"
    )
    lines += phase_table(s.phases_s)
    return "\n".join(lines)


def phase_table(phases: dict[str, Distribution]) -> list[str]:
    """The router's phases (router/phases.py), per request: where TTFT and the rest went."""
    if not phases:
        return []
    lines = [f"{'phase (ms)':<22}{'mean':>10}{'p50':>10}{'p90':>10}"]
    for name, d in phases.items():
        lines.append(f"{name:<22}" + "".join(f"{1e3 * v:>10.1f}" for v in (d.mean, d.p50, d.p90)))
    return lines


def _clean(value: Any) -> Any:
    """Strict JSON: NaN (no data) and infinities become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def record_json(r: RequestRecord) -> dict[str, Any]:
    return {
        "index": r.index,
        "send_s": r.send_s,
        "num_prompt_tokens": r.num_prompt_tokens,
        "num_output_tokens": r.num_output_tokens,
        "ttft_s": r.ttft_s if r.ok else None,
        "tpot_s": r.tpot_s if r.ok else None,
        "e2e_s": r.e2e_s if r.ok else None,
        "error": r.error,
        "phases_s": r.phases_s,
    }


def write_results(
    out_dir: Path, config: dict[str, Any], summary: Summary, records: list[RequestRecord]
) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    document = {
        "config": config,
        "summary": asdict(summary),
        "requests": [record_json(r) for r in records],
    }
    path.write_text(json.dumps(_clean(document), indent=1, allow_nan=False) + "\n")
    return path


def plot(out_dir: Path, records: list[RequestRecord], title: str) -> list[Path]:
    """Latency CDFs (TTFT, TPOT, end-to-end) and TTFT/TPOT by send time."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    done = [r for r in records if r.ok]
    series = {
        "TTFT": [r.ttft_s * 1e3 for r in done],
        "TPOT": [t * 1e3 for r in done if (t := r.tpot_s) is not None],
        "end-to-end": [r.e2e_s * 1e3 for r in done],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (name, values) in zip(axes, series.items(), strict=True):
        ordered = sorted(values)
        ax.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post")
        ax.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    paths = [out_dir / PLOTS[0]]
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 3.8))
    ax.plot([r.send_s for r in done], series["TTFT"], "o", ms=3, label="TTFT (ms)")
    tpot_points = [(r.send_s, t * 1e3) for r in done if (t := r.tpot_s) is not None]
    ax.plot([p[0] for p in tpot_points], [p[1] for p in tpot_points], "s", ms=3, label="TPOT (ms)")
    ax.set(title=f"{title}: latency by send time", xlabel="send time (s)", ylabel="ms")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / PLOTS[1])
    fig.savefig(paths[1], dpi=100)
    plt.close(fig)

    # Each request's phases stacked, in send order: where its TTFT (and the rest) went.
    names = list(dict.fromkeys(n for r in done for n in r.phases_s))
    fig, ax = plt.subplots(figsize=(9, 3.8))
    bottoms = [0.0] * len(done)
    for name in names:
        heights = [r.phases_s.get(name, 0.0) * 1e3 for r in done]
        ax.bar(range(len(done)), heights, bottom=bottoms, label=name, width=0.9)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.set(title=f"{title}: phases per request", xlabel="request (send order)", ylabel="ms")
    if names:
        ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    paths.append(out_dir / PLOTS[2])
    fig.savefig(paths[2], dpi=100)
    plt.close(fig)
    return paths
