"""The Helm chart, checked with the real tools: `helm lint`, `helm template`, and every
rendered manifest validated by `kubernetes-validate --strict` (Kubernetes 1.37); then what
matters, asserted on the rendered YAML."""

from __future__ import annotations

import argparse
import base64
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from app import settings
from app.embedded_redis import DISABLED_COMMANDS
from app.settings.flags import PEER_TOKEN_ENV, REDIS_PASSWORD_ENV
from engine.kv_layout import KVCacheDtype
from kvstore_service.config import KVStoreConfig
from pdserve.common.role import Role
from prefill_service.config import PrefillConfig

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pdserve"
VALUE_FILES = sorted((CHART / "ci").glob("*-values.yaml"))
KUBERNETES_VERSION = "1.37.0"
Manifest = dict[str, Any]


@pytest.fixture(scope="session")
def helm() -> str:
    """The helm binary the repository's own script fetches (make test does it first)."""
    path = ROOT / ".tools" / "helm"
    if not path.exists():
        subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "fetch_helm.py"), str(path)], check=True
        )
    return str(path)


def render(helm: str, *args: str) -> list[Manifest]:
    done = subprocess.run(
        [helm, "template", "rel", str(CHART), *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def find(manifests: list[Manifest], kind: str, name: str) -> Manifest:
    matches = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def pod_spec(manifests: list[Manifest], role: str) -> dict[str, Any]:
    spec: dict[str, Any] = find(manifests, "Deployment", f"rel-pdserve-{role}")["spec"]
    return spec["template"]["spec"]  # type: ignore[no-any-return]


def container(manifests: list[Manifest], role: str) -> dict[str, Any]:
    (only,) = pod_spec(manifests, role)["containers"]
    return only  # type: ignore[no-any-return]


def env(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


@pytest.mark.parametrize("values", [None, *VALUE_FILES], ids=lambda v: v.name if v else "default")
def test_lints_renders_and_validates_strictly(
    helm: str, values: Path | None, tmp_path: Path
) -> None:
    flags = ["-f", str(values)] if values else []
    lint = subprocess.run(
        [helm, "lint", "--strict", str(CHART), *flags], capture_output=True, text=True
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    manifests = render(helm, *flags)
    out = tmp_path / "rendered.yaml"
    out.write_text(yaml.safe_dump_all(manifests))
    validate = ROOT / ".venv" / "bin" / "kubernetes-validate"
    command = [str(validate) if validate.exists() else "kubernetes-validate"]
    command += ["--strict", "--kubernetes-version", KUBERNETES_VERSION, "--no-warn", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    # Custom resources (KEDA, ServiceMonitor, KubeRay) have no schema there: only these kinds.
    core = {"v1", "apps/v1", "policy/v1", "autoscaling/v2", "networking.k8s.io/v1", "batch/v1"}
    core |= {"rbac.authorization.k8s.io/v1", "admissionregistration.k8s.io/v1"}
    custom = {m["kind"] for m in manifests if m["apiVersion"] not in core}
    assert custom <= {"ScaledObject", "ServiceMonitor", "RayCluster", "Certificate"}


def test_each_pool_follows_its_own_replicas(helm: str) -> None:
    manifests = render(helm, "--set", "prefill.replicas=3", "--set", "decode.replicas=5")
    assert find(manifests, "Deployment", "rel-pdserve-prefill")["spec"]["replicas"] == 3
    assert find(manifests, "Deployment", "rel-pdserve-decode")["spec"]["replicas"] == 5
    production = render(helm, "-f", str(CHART / "ci" / "gpu-production-values.yaml"))
    assert find(production, "Deployment", "rel-pdserve-prefill")["spec"]["replicas"] == 4
    assert find(production, "Deployment", "rel-pdserve-decode")["spec"]["replicas"] == 8
    # Under an autoscaler the Deployment leaves replicas to it.
    scaled = render(helm, "-f", str(CHART / "ci" / "cpu-small-values.yaml"))
    assert "replicas" not in find(scaled, "Deployment", "rel-pdserve-decode")["spec"]
    hpa = find(scaled, "HorizontalPodAutoscaler", "rel-pdserve-decode")["spec"]
    assert hpa["scaleTargetRef"]["name"] == "rel-pdserve-decode" and hpa["maxReplicas"] == 4
    assert [m["type"] for m in hpa["metrics"]] == ["Resource", "Pods"]


def test_gpus_land_on_the_worker_pods_only(helm: str) -> None:
    manifests = render(helm, "--set", "decode.resources.limits.nvidia\\.com/gpu=2")
    gpus = {
        role: container(manifests, role)["resources"].get("limits", {}).get("nvidia.com/gpu")
        for role in ("router", "prefill", "decode")
    }
    assert gpus == {"router": None, "prefill": 1, "decode": 2}
    redis = find(manifests, "StatefulSet", "rel-pdserve-redis")["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in str(redis["containers"][0]["resources"])
    production = render(helm, "-f", str(CHART / "ci" / "gpu-production-values.yaml"))
    for role in ("prefill", "decode"):
        spec = pod_spec(production, role)
        assert spec["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == 1
        assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
        assert "nvidia.com/gpu.product" in spec["nodeSelector"]


def test_probes_drain_hook_and_security_context(helm: str) -> None:
    manifests = render(helm)
    for role in ("router", "prefill", "decode"):
        spec = pod_spec(manifests, role)
        c = spec["containers"][0]
        grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
        if role == "router":  # the OpenAI API's /health (on by default): SERVING, not draining
            assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        else:
            assert c["readinessProbe"]["grpc"]["port"] == grpc_port  # the standard health
        if role == "router":
            assert c["livenessProbe"]["tcpSocket"]["port"] == "grpc"  # draining is alive
        else:  # progress of the engine, not health (draining is alive) nor a TCP check
            assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "metrics"}
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]  # the only writable path
        drain_s = float(env(c)["PDSERVE_DRAIN_TIMEOUT_S"])
        assert spec["terminationGracePeriodSeconds"] > drain_s
        model = next(m for m in c["volumeMounts"] if m["name"] == "model")
        assert model["readOnly"] is True  # whatever the source: only the init container writes
        state = next(m for m in c["volumeMounts"] if m["name"] == "state")
        assert env(c)["PDSERVE_LAST_KNOWN_WORKERS"].startswith(state["mountPath"] + "/")
        assert {"name": "state", "emptyDir": {"sizeLimit": "16Mi"}} in spec["volumes"]
        if role == "router":  # serves on while the endpoints drop it, then drains (GOAWAY)
            pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
            assert pre_stop[0] == "sleep"
            assert spec["terminationGracePeriodSeconds"] >= drain_s + float(pre_stop[1])
    for role in ("prefill", "decode"):
        c = container(manifests, role)
        hook = " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
        assert 'pdserve drain "$PDSERVE_WORKER_ID"' in hook
        assert env(c)["PDSERVE_WORKER_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env(c)["PDSERVE_ADVERTISE_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def _flags(role: str) -> set[str]:
    """Env names of every flag `pdserve <role>` accepts (settings.env_name)."""
    from app.cli import build_parser

    sub = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    ).choices[role]
    flags = {
        settings.env_name(s) for a in sub._actions for s in a.option_strings if s.startswith("--")
    }
    return flags | {REDIS_PASSWORD_ENV, PEER_TOKEN_ENV}  # secrets: the environment only


def test_every_pdserve_variable_is_a_real_flag_and_pools_share_one_shape(helm: str) -> None:
    manifests = render(helm)
    names = {}
    for role in ("router", "prefill", "decode"):
        c = container(manifests, role)
        assert c["args"][0] == role
        names[role] = {n for n in env(c) if n.startswith("PDSERVE_")}
        unknown = names[role] - _flags(role) - {"PDSERVE_LOG_LEVEL"}  # the top-level flag
        assert not unknown, f"{role}: the chart sets {unknown}, which pdserve {role} ignores"
    # One helper renders both pools: they differ only in their role-specific flags.
    prefill_only = {"PDSERVE_KV_PORT", "PDSERVE_LEASE_S", "PDSERVE_KV_STORE_REPLICAS"}
    assert names["prefill"] - prefill_only == names["decode"] - {"PDSERVE_TRANSFER_TIMEOUT_S"}
    prefill, decode = pod_spec(manifests, "prefill"), pod_spec(manifests, "decode")
    assert prefill.keys() == decode.keys()
    assert prefill["containers"][0].keys() == decode["containers"][0].keys()


def test_redis_bundled_or_external(helm: str) -> None:
    bundled = render(helm)
    find(bundled, "StatefulSet", "rel-pdserve-redis")
    variables = env(container(bundled, "prefill"))
    # The password beside the URL, not inside it: nothing in it needs escaping.
    assert variables["PDSERVE_REDIS"] == "redis://rel-pdserve-redis:6379/0"
    assert variables[REDIS_PASSWORD_ENV] == {
        "secretKeyRef": {"name": "rel-pdserve-redis", "key": "password"}
    }
    assert find(bundled, "Secret", "rel-pdserve-redis")["data"]["password"]
    # One per-release token for internal calls, on every component, from one Secret.
    assert find(bundled, "Secret", "rel-pdserve-peer-token")["data"]["token"]
    for role in ("router", "prefill", "decode"):
        token = env(container(bundled, role))[PEER_TOKEN_ENV]
        assert token == {"secretKeyRef": {"name": "rel-pdserve-peer-token", "key": "token"}}
    server = find(bundled, "StatefulSet", "rel-pdserve-redis")["spec"]["template"]["spec"]
    redis = server["containers"][0]
    args = redis["args"]
    # The password comes as config on stdin (redis-server -), never on argv.
    assert "--requirepass" not in args and "REDIS_PASSWORD" not in str(args)
    assert (
        redis["command"][:2] == ["sh", "-c"]
        and 'exec redis-server - "$@" <<EOF' in redis["command"][2]
    )
    renamed = {args[i + 1] for i, a in enumerate(args) if a == "--rename-command"}
    assert renamed == set(DISABLED_COMMANDS)
    assert all(args[i + 2] == "" for i, a in enumerate(args) if a == "--rename-command")
    external = render(helm, "-f", str(CHART / "ci" / "external-redis-values.yaml"))
    assert not [m for m in external if m["kind"] == "StatefulSet"]
    for role in ("router", "prefill", "decode"):
        ref = env(container(external, role))["PDSERVE_REDIS"]
        assert ref == {"secretKeyRef": {"name": "pdserve-redis-url", "key": "url"}}
    missing = subprocess.run(
        [helm, "template", "rel", str(CHART), "--set", "redis.mode=external"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert missing.returncode != 0 and "redis.external.url" in missing.stderr


def test_model_comes_from_one_path_for_every_pool(helm: str) -> None:
    manifests = render(helm, "-f", str(CHART / "ci" / "external-redis-values.yaml"))
    for role in ("router", "prefill", "decode"):
        spec = pod_spec(manifests, role)
        (init,) = spec["initContainers"]
        assert init["command"] == ["hf", "download"]
        assert init["args"][0] == "Qwen/Qwen3-8B" and "/models/Qwen3-8B" in init["args"]
        assert env(spec["containers"][0])["PDSERVE_MODEL"] == "/models/Qwen3-8B"
        volume = next(v for v in spec["volumes"] if v["name"] == "model")
        assert volume["persistentVolumeClaim"]["claimName"] == "pdserve-model-cache"
        # The downloader writes the weights; the server that runs them cannot.
        assert {"name": "model", "mountPath": "/models"} in init["volumeMounts"]
        served = next(m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "model")
        assert served["readOnly"] is True


def test_network_policies_isolate_workers_and_redis(helm: str) -> None:
    manifests = render(helm)
    peers = {"app.kubernetes.io/instance": "rel", "app.kubernetes.io/part-of": "pdserve"}
    for name in ("rel-pdserve-prefill", "rel-pdserve-decode", "rel-pdserve-redis"):
        ingress = find(manifests, "NetworkPolicy", name)["spec"]["ingress"]
        assert ingress[0]["from"] == [{"podSelector": {"matchLabels": peers}}]
    router = find(manifests, "NetworkPolicy", "rel-pdserve-router")["spec"]["ingress"]
    assert "from" not in router[0]  # the router's gRPC port is the public one
    # The metrics port, by default: Prometheus only (the kubelet's probes come from the node).
    prometheus = {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }
    for name in ("rel-pdserve-router", "rel-pdserve-prefill", "rel-pdserve-decode"):
        ingress = find(manifests, "NetworkPolicy", name)["spec"]["ingress"]
        metrics = [rule for rule in ingress if rule["ports"] == [{"port": 9090}]]
        assert metrics and all(rule["from"][0] == prometheus for rule in metrics), name


def test_ray_mode_renders_a_raycluster_and_the_ray_up_job(helm: str) -> None:
    manifests = render(helm, "-f", str(CHART / "ci" / "ray-mode-values.yaml"))
    assert not [m for m in manifests if m["kind"] == "Deployment"]
    cluster = find(manifests, "RayCluster", "rel-pdserve-ray")["spec"]
    (group,) = cluster["workerGroupSpecs"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 4
    job = find(manifests, "Job", "rel-pdserve-ray-up")["spec"]["template"]["spec"]
    args = job["containers"][0]["args"]
    assert args[:4] == ["ray", "up", "--address", "ray://rel-pdserve-ray-head-svc:10001"]
    flags = dict(zip(args[4::2], args[5::2], strict=True))
    assert flags["--prefill"] == "2" and flags["--decode"] == "4"
    assert flags["--kv-backend"] == "ray" and flags["--num-gpus-per-worker"] == "1"


def test_helm_test_hook_generates_through_the_router(helm: str) -> None:
    pod = find(render(helm), "Pod", "rel-pdserve-test-generate")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (command,) = pod["spec"]["containers"][0]["args"]
    assert command.startswith("pdserve generate --router rel-pdserve-router:50051 --prompt")


@pytest.fixture
def bad_values(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "bad-values.yaml"
    path.write_text("prefill:\n  replicas: four\n  gpus: 2\nmodel:\n  dtype: int4\n")
    yield path


def test_invalid_values_are_rejected_by_the_schema_readably(helm: str, bad_values: Path) -> None:
    done = subprocess.run(
        [helm, "template", "rel", str(CHART), "-f", str(bad_values)], capture_output=True, text=True
    )
    assert done.returncode != 0
    assert "at '/prefill/replicas': got string, want integer" in done.stderr
    assert "additional properties 'gpus' not allowed" in done.stderr
    assert "at '/model/dtype'" in done.stderr


def test_keda_scales_queue_depth_per_replica_and_kv_usage_as_a_ratio(helm: str) -> None:
    manifests = render(helm, "-f", str(CHART / "ci" / "external-redis-values.yaml"))
    prefill = find(manifests, "ScaledObject", "rel-pdserve-prefill")["spec"]["triggers"][0]
    decode = find(manifests, "ScaledObject", "rel-pdserve-decode")["spec"]["triggers"][0]
    # A queue length divides across replicas; a usage ratio in [0, 1] does not: averaging it
    # would cap the pool at ceil(1 / threshold) replicas.
    assert prefill["metricType"] == "AverageValue"
    assert 'pdserve_queue_depth{job="rel-pdserve-prefill"}' in prefill["metadata"]["query"]
    assert decode["metricType"] == "Value"
    assert "pdserve_kv_blocks_free" in decode["metadata"]["query"]


def test_tls_mounts_the_certificate_and_passes_its_flags_to_every_component(helm: str) -> None:
    manifests = render(helm, "-f", str(CHART / "ci" / "tls-values.yaml"))
    certificate = find(manifests, "Certificate", "rel-pdserve-tls")["spec"]
    assert certificate["secretName"] == "rel-pdserve-tls"
    assert "pdserve" in certificate["dnsNames"] and "rel-pdserve-router" in certificate["dnsNames"]
    assert {"server auth", "client auth"} <= set(certificate["usages"])
    assert certificate["issuerRef"] == {
        "name": "pdserve-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"
    }  # fmt: skip
    for role in ("router", "prefill", "decode"):
        c, spec = container(manifests, role), pod_spec(manifests, role)
        assert env(c)["PDSERVE_TLS_CERT"] == "/etc/pdserve/tls/tls.crt"
        assert env(c)["PDSERVE_TLS_KEY"] == "/etc/pdserve/tls/tls.key"
        assert env(c)["PDSERVE_TLS_CA"] == "/etc/pdserve/tls/ca.crt"
        assert "PDSERVE_INSECURE" not in env(c)
        assert {"name": "tls", "mountPath": "/etc/pdserve/tls", "readOnly": True} in c[
            "volumeMounts"
        ]
        tls_volume = next(v for v in spec["volumes"] if v["name"] == "tls")
        assert tls_volume["secret"]["secretName"] == "rel-pdserve-tls"
        # kubelet's gRPC probe speaks no TLS: readiness is the metrics port's /healthz, or
        # the router's HTTPS /health.
        want = (
            {"path": "/health", "port": "http", "scheme": "HTTPS"}
            if role == "router"
            else {"path": "/healthz", "port": "metrics"}
        )
        assert c["readinessProbe"]["httpGet"] == want
    router = container(manifests, "router")
    assert env(router)["PDSERVE_API_KEY_FILE"] == "/etc/pdserve/api-keys/keys"
    keys = next(v for v in pod_spec(manifests, "router")["volumes"] if v["name"] == "api-keys")
    assert keys["secret"]["secretName"] == "pdserve-api-keys"
    test_pod = find(manifests, "Pod", "rel-pdserve-test-generate")["spec"]["containers"][0]
    assert env(test_pod)["PDSERVE_TLS_CA"] == "/etc/pdserve/tls/ca.crt"
    assert "PDSERVE_API_KEY" in test_pod["args"][0]
    # An existing Secret instead of cert-manager: no Certificate, that Secret mounted.
    own = render(helm, "--set", "tls.enabled=true", "--set", "tls.existingSecret=my-certs")
    assert not [m for m in own if m["kind"] == "Certificate"]
    volume = next(v for v in pod_spec(own, "decode")["volumes"] if v["name"] == "tls")
    assert volume["secret"]["secretName"] == "my-certs"


def test_without_tls_every_component_runs_insecure_with_grpc_probes(helm: str) -> None:
    manifests = render(helm)
    for role in ("router", "prefill", "decode"):
        c = container(manifests, role)
        assert env(c)["PDSERVE_INSECURE"] == "true" and "PDSERVE_TLS_CERT" not in env(c)
        assert "grpc" in c["readinessProbe"] or role == "router"


TLS_ON = ["--set", "tls.enabled=true"]
BOTH = [*TLS_ON, "--set", "tls.existingSecret=s", "--set", "tls.certManager.issuerRef.name=i"]
RAY = [*TLS_ON, "--set", "tls.existingSecret=s", "--set", "ray.enabled=true"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (TLS_ON, "minLength: got 0, want 1"),
        (BOTH, "maxLength: got 1, want 0"),
        (RAY, "in Ray mode the actors run with --insecure"),
    ],
    ids=["neither", "both", "ray-mode"],
)
def test_half_configured_tls_is_refused(helm: str, flags: list[str], message: str) -> None:
    done = subprocess.run(
        [helm, "template", "rel", str(CHART), *flags], capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0 and message in done.stderr, done.stderr


def test_ray_mode_renders_network_policies_for_its_pods(helm: str) -> None:
    manifests = render(helm, "-f", str(CHART / "ci" / "ray-mode-values.yaml"))
    ray = find(manifests, "NetworkPolicy", "rel-pdserve-ray")["spec"]
    assert ray["podSelector"]["matchLabels"]["pdserve.io/role"] == "ray"
    # The dashboard (its Jobs API runs code) is reached by this release's pods only.
    peers, router = ray["ingress"]
    assert peers["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "rel"
    assert router["ports"] == [{"port": 50051}]
    assert find(manifests, "NetworkPolicy", "rel-pdserve-redis")
    opened = render(
        helm,
        "-f",
        str(CHART / "ci" / "ray-mode-values.yaml"),
        "--set-json",
        'networkPolicy.rayDashboardIngressFrom=[{"podSelector":{"matchLabels":{"app":"ops"}}}]',
    )
    dashboard = find(opened, "NetworkPolicy", "rel-pdserve-ray")["spec"]["ingress"][2]
    assert dashboard == {
        "ports": [{"port": 8265}],
        "from": [{"podSelector": {"matchLabels": {"app": "ops"}}}],
    }


def test_ray_mode_turns_on_ray_token_auth_everywhere(helm: str) -> None:
    manifests = render(helm, "-f", str(CHART / "ci" / "ray-mode-values.yaml"))
    ray = find(manifests, "RayCluster", "rel-pdserve-ray")["spec"]
    job = find(manifests, "Job", "rel-pdserve-ray-up")["spec"]["template"]["spec"]
    containers = [
        ray["headGroupSpec"]["template"]["spec"]["containers"][0],
        *(g["template"]["spec"]["containers"][0] for g in ray["workerGroupSpecs"]),
        job["containers"][0],
    ]
    for c in containers:
        variables = {e["name"]: e for e in c["env"]}
        assert variables["RAY_AUTH_MODE"]["value"] == "token", c["name"]
        ref = variables["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "rel-pdserve-ray-auth", "key": "auth_token"}, c["name"]
    token = find(manifests, "Secret", "rel-pdserve-ray-auth")["data"]["auth_token"]
    assert len(base64.b64decode(token)) == 48
    given = render(
        helm,
        "-f",
        str(CHART / "ci" / "ray-mode-values.yaml"),
        "--set",
        "ray.auth.existingSecret=mine",
    )
    secrets = [m["metadata"]["name"] for m in given if m["kind"] == "Secret"]
    assert "rel-pdserve-ray-auth" not in secrets
    head = find(given, "RayCluster", "rel-pdserve-ray")["spec"]["headGroupSpec"]
    env = {e["name"]: e for e in head["template"]["spec"]["containers"][0]["env"]}
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "mine"


def test_ray_mode_refuses_api_keys_it_could_not_apply(helm: str) -> None:
    flags = ["--set", "ray.enabled=true", "--set", "router.apiKeys.existingSecret=keys"]
    done = subprocess.run(
        [helm, "template", "rel", str(CHART), *flags], capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0 and "router.apiKeys is for the Deployments mode" in done.stderr


def test_the_openai_http_api_port_service_and_probe(helm: str) -> None:
    manifests = render(helm, "--set", "router.http.servedModelName=chat")
    c = container(manifests, "router")
    assert env(c)["PDSERVE_HTTP_PORT"] == "8000" and env(c)["PDSERVE_SERVED_MODEL_NAME"] == "chat"
    assert {"name": "http", "containerPort": 8000} in c["ports"]
    service = find(manifests, "Service", "rel-pdserve-router")["spec"]["ports"]
    assert {"name": "http", "port": 8000, "targetPort": "http", "appProtocol": "http"} in service
    policy = find(manifests, "NetworkPolicy", "rel-pdserve-router")["spec"]["ingress"][0]
    assert {"port": 8000} in policy["ports"]
    off = render(helm, "--set", "router.http.port=0")
    c = container(off, "router")
    assert "PDSERVE_HTTP_PORT" not in env(c) and "grpc" in c["readinessProbe"]
    ports = find(off, "Service", "rel-pdserve-router")["spec"]["ports"]
    assert all(p["name"] != "http" for p in ports)


def test_speculative_decoding_reaches_the_decode_pool_only(helm: str) -> None:
    values = ["--set", "decode.speculative.method=draft"]
    values += ["--set", "decode.speculative.draftModel=/models/draft"]
    values += ["--set", "decode.speculative.numSpeculativeTokens=4"]
    manifests = render(helm, *values)
    assert not [n for n in env(container(manifests, "prefill")) if "SPEC" in n]
    variables = {k: v for k, v in env(container(manifests, "decode")).items() if isinstance(v, str)}
    parser = argparse.ArgumentParser()
    settings.add_service_flags(parser, Role.DECODE, env=variables)
    spec = settings.service_config(Role.DECODE, parser.parse_args([])).engine.speculative
    assert spec is not None and spec.method.value == "draft"
    assert (spec.draft_model, spec.num_speculative_tokens) == ("/models/draft", 4)
    # Ray mode: the same values become `pdserve ray up` flags.
    ray = render(helm, "-f", str(CHART / "ci" / "ray-mode-values.yaml"), *values)
    args = find(ray, "Job", "rel-pdserve-ray-up")["spec"]["template"]["spec"]["containers"][0]
    flags = dict(zip(args["args"][4::2], args["args"][5::2], strict=True))
    assert flags["--speculative-method"] == "draft"
    assert flags["--spec-draft-model"] == "/models/draft"


@pytest.mark.parametrize(
    ("values", "named"),
    [
        (["decode.speculative.method=draft"], "draftModel"),
        (["prefill.speculative.method=ngram"], "prefill"),
        (["decode.speculative.method=eagle"], "method"),
    ],
)
def test_bad_speculative_values_are_refused(helm: str, values: list[str], named: str) -> None:
    args = [a for v in values for a in ("--set", v)]
    done = subprocess.run(
        [helm, "template", "rel", str(CHART), *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0 and named in done.stderr, done.stderr


def test_the_host_tier_size_reaches_the_worker_config(helm: str) -> None:
    manifests = render(helm, "--set", "decode.engine.hostCacheGib=8")
    variables = {k: v for k, v in env(container(manifests, "decode")).items() if isinstance(v, str)}
    parser = argparse.ArgumentParser()
    settings.add_service_flags(parser, Role.DECODE, env=variables)
    assert (
        settings.service_config(Role.DECODE, parser.parse_args([])).engine.cache.host_cache_gib == 8
    )
    assert "PDSERVE_HOST_CACHE_GIB" not in env(container(manifests, "prefill"))  # 0: off


def test_the_kv_cache_dtype_reaches_every_component(helm: str) -> None:
    """One value for the router (its fingerprint) and both pools (their caches and layouts);
    the Ray-mode driver reads the same environment."""
    manifests = render(helm, "--set", "kvCacheDtype=int8")
    for role in ("router", "prefill", "decode"):
        variables = {k: v for k, v in env(container(manifests, role)).items() if isinstance(v, str)}
        parser = argparse.ArgumentParser()
        settings.add_service_flags(parser, Role(role), env=variables)
        config = settings.service_config(Role(role), parser.parse_args([]))
        kind = (
            config.layout.kv_cache_dtype if role == "router" else config.engine.cache.kv_cache_dtype
        )  # type: ignore[union-attr]
        assert kind is KVCacheDtype.INT8, role
    ray = render(
        helm, "-f", str(CHART / "ci" / "ray-mode-values.yaml"), "--set", "kvCacheDtype=int8"
    )
    job = find(ray, "Job", "rel-pdserve-ray-up")["spec"]["template"]["spec"]["containers"][0]
    assert env(job)["PDSERVE_KV_CACHE_DTYPE"] == "int8"
    done = subprocess.run(
        [helm, "template", "rel", str(CHART), "--set", "kvCacheDtype=int4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "kvCacheDtype" in done.stderr, done.stderr


def test_tracing_reaches_every_component_and_bad_values_are_refused(helm: str) -> None:
    endpoint = "tracing.otlpEndpoint=http://otel-collector.obs:4317"
    manifests = render(helm, "--set", endpoint, "--set-json", "tracing.sampleRatio=0.25")
    for role in ("router", "prefill", "decode"):
        e = env(container(manifests, role))
        assert e["PDSERVE_OTLP_ENDPOINT"] == "http://otel-collector.obs:4317"
        assert e["PDSERVE_TRACE_SAMPLE_RATIO"] == "0.25"
    assert "PDSERVE_OTLP_ENDPOINT" not in env(container(render(helm), "router"))  # off
    for flags, named in (
        (["--set-json", "tracing.sampleRatio=2"], "/tracing/sampleRatio"),
        (["--set", "tracing.otlpEndpoint=otel:4317"], "/tracing/otlpEndpoint"),
    ):
        done = subprocess.run(
            [helm, "template", "rel", str(CHART), *flags], capture_output=True, text=True
        )
        assert done.returncode != 0 and named in done.stderr, done.stderr


def test_kv_stores_render_with_real_flags_and_the_prefill_pool_writes_to_them(helm: str) -> None:
    """``kvstore.replicas`` renders the stores (none by default); every variable the chart
    gives a store or the prefill pool is a flag their configs read."""
    assert not [m for m in render(helm) if m["metadata"]["name"].endswith("-kvstore")]
    manifests = render(helm, "-f", str(CHART / "ci" / "kvstore-values.yaml"))
    deployment = find(manifests, "Deployment", "rel-pdserve-kvstore")
    assert deployment["spec"]["replicas"] == 2
    assert {m["kind"] for m in manifests if m["metadata"]["name"] == "rel-pdserve-kvstore"} == {
        "Deployment",
        "Service",
        "NetworkPolicy",
    }
    configs = {}
    for role in (Role.KVSTORE, Role.PREFILL):
        c = container(manifests, role.value)
        assert c["args"][0] == role.value
        variables = {k: v for k, v in env(c).items() if isinstance(v, str)}
        unknown = {n for n in variables if n.startswith("PDSERVE_")} - _flags(role.value)
        assert not unknown - {"PDSERVE_LOG_LEVEL"}, f"{role.value}: {unknown}"
        parser = argparse.ArgumentParser()
        settings.add_service_flags(parser, role, env={**variables, "PDSERVE_MODEL": "/m"})
        configs[role] = settings.service_config(role, parser.parse_args([]))
    store, prefill = configs[Role.KVSTORE], configs[Role.PREFILL]
    assert isinstance(store, KVStoreConfig) and isinstance(prefill, PrefillConfig)
    assert (store.capacity_gib, store.kv_port, prefill.kv_store_replicas) == (8.0, 50091, 2)
