"""Every panel of the Grafana dashboard (helm/pdserve/dashboards/pdserve.json) reads metrics
that exist: each PromQL expression's metric names are exported by a running cluster's
/metrics (router, prefill and decode workers, and ``pdserve autoscale``'s own), and the labels
it groups by are labels those metrics carry. A renamed metric or label fails here instead of
leaving a panel silently empty."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from app.capacity.profile import save
from app.cluster_control import serve_control
from app.local_cluster import ClusterConfig, LocalCluster
from engine import SamplingParams
from tests.capacity.test_simulator import constant_profile
from tests.faults.faults_util import requests_for, run_streams

pytestmark = pytest.mark.slow
DASHBOARD = Path(__file__).parents[2] / "helm" / "pdserve" / "dashboards" / "pdserve.json"
# Labels Prometheus adds when it scrapes, and the histogram bucket bound.
SCRAPE_LABELS = {"job", "instance", "le"}


def expressions() -> list[str]:
    import json

    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def exported(text: str) -> dict[str, set[str]]:
    """Sample name -> label names, from a /metrics page, including the sample names of
    labelled families no request has touched yet (only their HELP and TYPE are listed)."""
    names: dict[str, set[str]] = {}
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "gauge": ("",),
        "summary": ("_sum", "_count", "_created"),
    }
    for family in text_string_to_metric_families(text):
        labels = {k for s in family.samples for k in s.labels}
        for suffix in suffixes.get(family.type, ("",)):
            names.setdefault(family.name + suffix, set()).update(labels)
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def declared(name: str) -> set[str]:
    """The label names a metric is defined with (the code those processes run), for families
    the page lists without samples (a reason no request has had yet)."""
    # Every module that defines the metrics of a process the test scrapes: a test that ran
    # before in this process must not be what registered them.
    import app.capacity.autoscaler  # noqa: F401
    import kvstore_service.store_metrics  # noqa: F401
    import pdserve.common.metrics  # noqa: F401

    collector = REGISTRY._names_to_collectors.get(name)  # type: ignore[attr-defined]
    return set(getattr(collector, "_labelnames", ()))


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        return str(reply.read().decode())


def test_every_dashboard_query_reads_metrics_a_running_cluster_exports(
    llama_dir: Path, redis_url: str, tmp_path: Path
) -> None:
    config = ClusterConfig(
        model=str(llama_dir),
        redis_url=redis_url,
        redis_namespace=tmp_path.name,
        log_dir=tmp_path,
        router_args=("--local-prefill-tokens", "0"),
        num_kvstore=1,
    )
    profile = tmp_path / "profile.json"
    save(constant_profile(prefill_s=0.01, decode_s=0.01), profile)
    pages: list[str] = []
    with LocalCluster(config) as cluster:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

        async def one() -> None:  # histograms and labelled counters get their samples
            streams, tasks = await run_streams(
                cluster.address, requests_for([[3, *range(40, 60)]], [params])
            )
            await asyncio.gather(*tasks)
            assert streams[0].error is None

        asyncio.run(one())
        control, port = serve_control(cluster, "127.0.0.1", 0)
        flags = (
            f"autoscale --target local --control 127.0.0.1:{port} --profile {profile} "
            "--slo-ttft-ms 1000 --slo-tpot-ms 200 --interval-s 1 --dry-run "
            "--host 127.0.0.1 --metrics-port 0"
        )
        autoscale = subprocess.Popen(
            [sys.executable, "-m", "app", *flags.split()],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert autoscale.stdout is not None
            line = autoscale.stdout.readline()
            assert line.startswith("pdserve autoscale metrics "), line
            pages.append(scrape(line.split()[-1]))
            for component in cluster.components:
                pages.append(scrape(component.metrics_address))
        finally:
            autoscale.terminate()
            autoscale.wait(timeout=60)
            control.stop(grace=None)

    available: dict[str, set[str]] = {}
    for page in pages:
        for name, labels in exported(page).items():
            available.setdefault(name, set()).update(labels)
    missing: list[str] = []
    for expr in expressions():
        used = set(re.findall(r"\bpdserve_[a-z0-9_]+\b", expr))
        assert used, f"a panel reads no pdserve metric: {expr}"
        missing += [f"{name} (in {expr})" for name in used if name not in available]
        grouped = {
            label.strip()
            for clause in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", expr)
            for label in clause.split(",")
        } - SCRAPE_LABELS
        carried = set().union(*(available.get(name, set()) | declared(name) for name in used))
        missing += [f"label {label} (in {expr})" for label in grouped - carried]
    assert not missing, "dashboard queries no running component exports:\n" + "\n".join(missing)
