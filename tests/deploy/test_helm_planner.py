"""The chart's planner (``pdserve autoscale --target kubernetes``) and Grafana dashboard: the
planner's RBAC grants exactly what it uses, it owns the pools' replicas (refused next to an
HPA or KEDA), its arguments are real flags, and every metric the dashboard queries is one
pdserve exports."""

from __future__ import annotations

import json
import re
import subprocess

import yaml
from prometheus_client import REGISTRY

from tests.deploy.test_helm_chart import CHART, find, helm, pod_spec, render

__all__ = ["helm"]  # the session fixture, shared with the chart's other tests
VALUES = str(CHART / "ci" / "planner-values.yaml")


def test_the_planner_gets_a_role_limited_to_what_it_uses(helm: str) -> None:
    manifests = render(helm, "-f", VALUES)
    role = find(manifests, "Role", "rel-pdserve-planner")
    assert role["rules"] == [
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/scale"],
            "resourceNames": ["rel-pdserve-prefill", "rel-pdserve-decode"],
            "verbs": ["get", "patch"],
        },
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "patch"]},
    ]
    # RBAC cannot limit a patch's fields: an admission policy lets the planner's pod updates
    # change the deletion-cost annotation only (not an image, a label, another annotation).
    policy = find(manifests, "ValidatingAdmissionPolicy", "default-rel-pdserve-planner-pod-patches")
    (condition,) = policy["spec"]["matchConditions"]
    account = "system:serviceaccount:default:rel-pdserve-planner"
    assert condition["expression"] == f"request.userInfo.username == '{account}'"
    assert policy["spec"]["matchConstraints"]["resourceRules"][0]["operations"] == ["UPDATE"]
    (rule,) = policy["spec"]["validations"]
    assert "object.spec == oldObject.spec" in rule["expression"]
    assert "pod-deletion-cost" in rule["message"]
    bound = find(manifests, "ValidatingAdmissionPolicyBinding", policy["metadata"]["name"])
    assert bound["spec"]["validationActions"] == ["Deny"]
    assert bound["spec"]["policyName"] == policy["metadata"]["name"]
    older = render(helm, "-f", VALUES, "--kube-version", "1.29.0")  # no such API there
    assert not [m for m in older if m["kind"] == "ValidatingAdmissionPolicy"]
    binding = find(manifests, "RoleBinding", "rel-pdserve-planner")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "rel-pdserve-planner", "namespace": "default"}
    ]
    assert binding["roleRef"]["name"] == "rel-pdserve-planner"
    planner = find(manifests, "Deployment", "rel-pdserve-planner")["spec"]
    spec = planner["template"]["spec"]
    assert planner["replicas"] == 1 and spec["serviceAccountName"] == "rel-pdserve-planner"
    assert spec["automountServiceAccountToken"] is True
    # Only the planner talks to the API server; the pools' sizes are its, not the chart's.
    for role_name in ("router", "prefill", "decode"):
        assert pod_spec(manifests, role_name)["automountServiceAccountToken"] is False
    for pool in ("prefill", "decode"):
        assert "replicas" not in find(manifests, "Deployment", f"rel-pdserve-{pool}")["spec"]
    # Its metrics are scraped like every component's (the dashboard's planner panels).
    service = find(manifests, "Service", "rel-pdserve-planner")["spec"]
    assert service["ports"] == [{"name": "metrics", "port": 9091, "targetPort": "metrics"}]
    monitored = render(helm, "-f", VALUES, "--set", "serviceMonitor.enabled=true")
    monitor = find(monitored, "ServiceMonitor", "rel-pdserve")["spec"]["selector"]
    assert "planner" in monitor["matchExpressions"][1]["values"]
    profile = find(manifests, "ConfigMap", "rel-pdserve-planner-profile")
    assert json.loads(profile["data"]["profile.json"]) == {"version": 1}


def test_the_planners_arguments_are_flags_of_pdserve_autoscale(helm: str) -> None:
    from app.cli import build_parser

    spec = find(render(helm, "-f", VALUES), "Deployment", "rel-pdserve-planner")["spec"]
    args = spec["template"]["spec"]["containers"][0]["args"]
    parsed = build_parser().parse_args(args)  # exits (SystemExit) on any unknown flag
    assert parsed.command == "autoscale" and parsed.target == "kubernetes"
    assert parsed.prefill_deployment == "rel-pdserve-prefill"
    assert parsed.decode_selector == "app.kubernetes.io/instance=rel,pdserve.io/role=decode"
    assert (parsed.slo_ttft_ms, parsed.slo_tpot_ms) == (800, 50)
    assert (parsed.min_decode, parsed.max_decode) == (2, 12)
    assert parsed.worker_metrics_port == [9090, 9090]
    assert (parsed.kv_target, parsed.prometheus) == (0.75, None)  # scrapes the pages
    prometheus = "http://prometheus-server.monitoring:9090"
    flags = ("-f", VALUES, "--set", f"planner.prometheus={prometheus}")
    flags += ("--set-json", "planner.kvTarget=0.9")
    spec = find(render(helm, *flags), "Deployment", "rel-pdserve-planner")["spec"]
    parsed = build_parser().parse_args(spec["template"]["spec"]["containers"][0]["args"])
    assert (parsed.kv_target, parsed.prometheus) == (0.9, prometheus)


def test_the_planner_is_refused_next_to_another_autoscaler_or_without_a_profile(
    helm: str,
) -> None:
    for flags, message in (
        (["--set", "decode.keda.enabled=true"], "/decode/keda/enabled"),
        (["--set", "prefill.autoscaling.enabled=true"], "/prefill/autoscaling/enabled"),
        (["--set", "planner.profile="], "/planner/profile"),
    ):
        done = subprocess.run(
            [helm, "template", "rel", str(CHART), "-f", VALUES, *flags],
            capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode != 0 and message in done.stderr, done.stderr


def _exported() -> set[str]:
    # Every module that defines metrics the dashboard reads (the autoscaler's too): not a test
    # that ran before in this process.
    import app.capacity.autoscaler  # noqa: F401
    import pdserve.common.metrics  # noqa: F401

    names = set()
    for family in REGISTRY.collect():
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names.update(family.name + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(family.name)
    return names


def test_every_metric_the_dashboard_queries_is_exported(helm: str) -> None:
    manifests = render(helm, "-f", VALUES)
    config_map = find(manifests, "ConfigMap", "rel-pdserve-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config_map["data"]["pdserve.json"])
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queried = {name for e in exprs for name in re.findall(r"\bpdserve_\w+", e)}
    assert len(queried) >= 15
    missing = queried - _exported()
    assert not missing, f"the dashboard queries metrics pdserve does not export: {missing}"
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("ttft", "tpot", "kv cache", "queue", "transfer", "prefix", "migrations",
                  "planner"):  # fmt: skip
        assert topic in titles
    assert yaml.safe_dump(dashboard)  # plain data, no template left unrendered
