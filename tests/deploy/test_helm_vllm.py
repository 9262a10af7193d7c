"""The chart with ``engine.backend: vllm``: one engine for the router (its fingerprint), both
pools and the Ray-mode driver; the workers on docker/Dockerfile.vllm's image with the vLLM
options; and the schema refusing, by the value's name, what the vLLM engine refuses."""

from __future__ import annotations

import argparse
import subprocess
from typing import Any

import pytest

from app import settings
from engine.config import EngineBackend, VllmEngineCore, VllmOptions
from pdserve.common.role import Role
from tests.deploy.test_helm_chart import (
    CHART,
    Manifest,
    _flags,
    container,
    env,
    find,
    helm,
    pod_spec,
    render,
)

__all__ = ["helm"]  # the session fixture, shared with the chart's other tests

VLLM = ["-f", str(CHART / "ci" / "vllm-values.yaml")]
RAY = ["-f", str(CHART / "ci" / "ray-mode-values.yaml")]
ROLES = ("router", "prefill", "decode")
VLLM_VARIABLES = {
    "PDSERVE_TENSOR_PARALLEL_SIZE",
    "PDSERVE_GPU_MEMORY_UTILIZATION",
    "PDSERVE_QUANTIZATION",
    "PDSERVE_ENFORCE_EAGER",
    "PDSERVE_ENGINE_CORE",
}


def _config(manifests: list[Manifest], role: str) -> Any:
    """The role's config, parsed from the container's environment as `pdserve <role>` does."""
    variables = {k: v for k, v in env(container(manifests, role)).items() if isinstance(v, str)}
    parser = argparse.ArgumentParser()
    settings.add_service_flags(parser, Role(role), env=variables)
    return settings.service_config(Role(role), parser.parse_args([]))


def _gpus(manifests: list[Manifest], role: str) -> dict[str, Any]:
    resources = container(manifests, role)["resources"]
    return {kind: resources.get(kind, {}).get("nvidia.com/gpu") for kind in ("requests", "limits")}


def test_the_vllm_engine_and_its_options_reach_every_component(helm: str) -> None:
    manifests = render(helm, *VLLM)
    router = _config(manifests, "router")
    assert router.layout.engine is EngineBackend.VLLM  # its fingerprint's engine
    for role in ("prefill", "decode"):
        engine = _config(manifests, role).engine
        assert engine.backend is EngineBackend.VLLM, role
        assert engine.vllm == VllmOptions(
            tensor_parallel_size=1,
            gpu_memory_utilization=0.85,
            quantization="fp8",
            enforce_eager=True,
        ), role
    # Every variable is a real flag of its command, and the pools still share one shape.
    names = {role: {n for n in env(container(manifests, role)) if n.startswith("PDSERVE_")}
             for role in ROLES}  # fmt: skip
    for role in ROLES:
        unknown = names[role] - _flags(role) - {"PDSERVE_LOG_LEVEL"}
        assert not unknown, f"{role}: the chart sets {unknown}, which pdserve {role} ignores"
    assert not names["router"] & VLLM_VARIABLES  # the router runs no engine
    prefill_only = {"PDSERVE_KV_PORT", "PDSERVE_LEASE_S", "PDSERVE_KV_STORE_REPLICAS"}
    assert names["prefill"] - prefill_only == names["decode"] - {"PDSERVE_TRANSFER_TIMEOUT_S"}


def test_workers_run_the_vllm_image_and_the_router_the_plain_one(helm: str) -> None:
    manifests = render(helm, *VLLM)
    assert container(manifests, "router")["image"] == "ghcr.io/pdserve/pdserve:0.1.0"
    for role in ("prefill", "decode"):
        assert container(manifests, role)["image"] == "ghcr.io/pdserve/pdserve:0.1.0-vllm"
    given = render(
        helm,
        *VLLM,
        "--set", "engine.vllm.image.repository=registry.local/pdserve-vllm",
        "--set", "engine.vllm.image.tag=0.1.0-cu129",
        "--set", "image.pullPolicy=Always",
        "--set", "model.source=download",
        "--set", "model.download.modelId=Qwen/Qwen3-30B-A3B",
    )  # fmt: skip
    for role in ("prefill", "decode"):
        spec = pod_spec(given, role)
        (init,) = spec["initContainers"]  # the weights come down with the pod's own image
        for c in (spec["containers"][0], init):
            assert c["image"] == "registry.local/pdserve-vllm:0.1.0-cu129", role
            assert c["imagePullPolicy"] == "Always"
    (router_init,) = pod_spec(given, "router")["initContainers"]
    assert router_init["image"] == "ghcr.io/pdserve/pdserve:0.1.0"


def test_each_worker_gets_at_least_tensor_parallel_size_gpus(helm: str) -> None:
    """Sized for tensor parallelism: every rank of a worker's engine gets a GPU of the pod."""
    tp4 = ["--set", "engine.vllm.tensorParallelSize=4"]
    manifests = render(helm, *VLLM, *tp4)
    assert _config(manifests, "decode").engine.vllm.tensor_parallel_size == 4
    # With ranks, vLLM's engine core runs in a process of its own (auto); asked for, always.
    process = render(helm, *VLLM, "--set", "engine.vllm.engineCore=process")
    assert _config(process, "prefill").engine.vllm.engine_core is VllmEngineCore.PROCESS
    for role in ("prefill", "decode"):
        assert env(container(manifests, role))["PDSERVE_TENSOR_PARALLEL_SIZE"] == "4"
        assert _gpus(manifests, role) == {"requests": None, "limits": 4}
    # Requests and limits both raised (a GPU's request must equal its limit); more is kept.
    production = render(
        helm,
        "-f", str(CHART / "ci" / "gpu-production-values.yaml"),
        "--set", "engine.backend=vllm",
        "--set", "engine.vllm.tensorParallelSize=2",
        "--set", "decode.resources.requests.nvidia\\.com/gpu=8",
        "--set", "decode.resources.limits.nvidia\\.com/gpu=8",
    )  # fmt: skip
    assert _gpus(production, "prefill") == {"requests": 2, "limits": 2}
    assert _gpus(production, "decode") == {"requests": 8, "limits": 8}
    # A pool that asks for no nvidia.com/gpu (another vendor's, MIG slices) is left as it is.
    other = render(
        helm, *VLLM, *tp4,
        "--set", "prefill.resources.limits.nvidia\\.com/gpu=null",
        "--set", "prefill.resources.limits.amd\\.com/gpu=4",
    )  # fmt: skip
    limits = container(other, "prefill")["resources"]["limits"]
    assert limits["amd.com/gpu"] == 4 and "nvidia.com/gpu" not in limits
    assert container(other, "router")["resources"] == container(render(helm), "router")["resources"]


def test_each_prefill_rank_serves_its_kv_shard_on_a_port_the_pod_opens(helm: str) -> None:
    """vLLM tensor parallelism: rank r of a prefill worker serves its shard on kvTransfer.port
    + r (grpc or nixl), so the pod names every one and the network policy admits them all."""
    manifests = render(
        helm, *VLLM, "--set", "engine.vllm.tensorParallelSize=2", "--set", "kvTransfer.backend=nixl"
    )
    prefill = _config(manifests, "prefill")
    assert prefill.kv_backend == "nixl" and prefill.engine.vllm.tensor_parallel_size == 2
    ports = {p["name"]: p["containerPort"] for p in container(manifests, "prefill")["ports"]}
    assert (ports["kv"], ports["kv-rank-1"]) == (50071, 50072)
    policy = find(manifests, "NetworkPolicy", "rel-pdserve-prefill")["spec"]["ingress"][0]
    assert {"port": 50071, "endPort": 50072, "protocol": "TCP"} in policy["ports"]
    one = render(helm, *VLLM)  # one rank: the one port, as before
    assert "kv-rank-1" not in {p["name"] for p in container(one, "prefill")["ports"]}


def test_ray_mode_runs_the_vllm_image_and_ray_up_passes_the_engine_on(
    helm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = [*RAY, "--set", "engine.backend=vllm", "--set", "ray.deployment.kvBackend=grpc"]
    values += ["--set-json", "ray.deployment.numGpusPerWorker=0.5"]
    values += ["--set", "engine.vllm.enforceEager=true"]
    manifests = render(helm, *values)
    cluster = find(manifests, "RayCluster", "rel-pdserve-ray")["spec"]
    job = find(manifests, "Job", "rel-pdserve-ray-up")["spec"]["template"]["spec"]["containers"][0]
    images = [
        cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["image"],
        *(g["template"]["spec"]["containers"][0]["image"] for g in cluster["workerGroupSpecs"]),
        job["image"],  # a Ray client: the cluster's Python and Ray
    ]
    assert set(images) == {"ghcr.io/pdserve/pdserve:0.1.0-vllm"}
    # `pdserve ray up` reads the same environment and passes it on to every worker actor.
    for name, value in env(job).items():
        if isinstance(value, str):
            monkeypatch.setenv(name, value)
    from app.cli import build_parser
    from app.ray_deploy.commands import _deployment_spec

    spec = _deployment_spec(build_parser().parse_args(job["args"]))
    assert spec.num_gpus_per_worker == 0.5  # TP 1: a GPU may be shared (gpuMemoryUtilization)
    assert spec.router.layout.engine is EngineBackend.VLLM
    for worker in (spec.prefill, spec.decode):
        assert worker.engine.backend is EngineBackend.VLLM
        assert worker.engine.vllm == VllmOptions(enforce_eager=True)
        assert worker.kv_backend == "grpc"
    # Tensor parallelism: each actor asks Ray for its GPUs.
    tp = render(helm, *values, "--set", "engine.vllm.tensorParallelSize=2")
    args = find(tp, "Job", "rel-pdserve-ray-up")["spec"]["template"]["spec"]["containers"][0]
    flags = dict(zip(args["args"][4::2], args["args"][5::2], strict=True))
    assert flags["--num-gpus-per-worker"] == "2"
    assert env(args)["PDSERVE_TENSOR_PARALLEL_SIZE"] == "2"


VLLM_ON = ["engine.backend=vllm"]


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ([*VLLM_ON, "ray.enabled=true"], "at '/ray/deployment/kvBackend': value must be 'grpc'"),
        ([*VLLM_ON, "kvCacheDtype=int8"], "at '/kvCacheDtype': value must be 'auto'"),
        ([*VLLM_ON, "decode.speculative.method=ngram"], "at '/decode/speculative/method'"),
        ([*VLLM_ON, "prefill.engine.hostCacheGib=4"], "at '/prefill/engine/hostCacheGib'"),
        ([*VLLM_ON, "decode.engine.hostCacheGib=4"], "at '/decode/engine/hostCacheGib'"),
        (["engine.vllm.tensorParallelSize=2"], "at '/engine/vllm/tensorParallelSize'"),
        (["engine.vllm.enforceEager=true"], "at '/engine/vllm/enforceEager'"),
        (["engine.vllm.engineCore=worker"], "at '/engine/vllm/engineCore'"),
        ([*VLLM_ON, "engine.vllm.engineCore=elsewhere"], "at '/engine/vllm/engineCore'"),
        (["engine.vllm.quantization=awq"], "at '/engine/vllm/quantization'"),
        ([*VLLM_ON, "engine.vllm.tensorParallelSize=0"], "at '/engine/vllm/tensorParallelSize'"),
        (["engine.backend=sglang"], "at '/engine/backend'"),
    ],
    ids=[
        "vllm-ray-transfer",
        "vllm-kv-int8",
        "vllm-speculative",
        "vllm-prefill-host-tier",
        "vllm-decode-host-tier",
        "native-tensor-parallel",
        "native-enforce-eager",
        "native-engine-core",
        "vllm-unknown-engine-core",
        "native-quantization",
        "vllm-zero-gpus",
        "unknown-engine",
    ],
)
def test_what_the_engine_refuses_the_schema_refuses_by_name(
    helm: str, values: list[str], named: str
) -> None:
    args = [a for v in values for a in ("--set", v)]
    for command in ("template", "lint"):
        target = ["rel", str(CHART)] if command == "template" else ["--strict", str(CHART)]
        done = subprocess.run(
            [helm, command, *target, *args], capture_output=True, text=True, timeout=60
        )
        assert done.returncode != 0 and named in done.stdout + done.stderr, done.stderr


def test_gpu_memory_utilization_must_be_a_fraction_for_vllm_only(helm: str) -> None:
    for value, named in (
        ("1.5", "at '/engine/vllm/gpuMemoryUtilization': maximum"),
        ("0", "at '/engine/vllm/gpuMemoryUtilization': exclusiveMinimum"),
    ):
        done = subprocess.run(
            [helm, "template", "rel", str(CHART), *VLLM,
             "--set-json", f"engine.vllm.gpuMemoryUtilization={value}"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode != 0 and named in done.stderr, done.stderr
    native = subprocess.run(
        [helm, "template", "rel", str(CHART), "--set-json", "engine.vllm.gpuMemoryUtilization=0.5"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert native.returncode != 0
    assert "at '/engine/vllm/gpuMemoryUtilization': got number, want null" in native.stderr


@pytest.mark.parametrize(
    ("values", "role", "refused"),
    [
        (["kvCacheDtype=int8"], "decode", "--kv-cache-dtype"),
        (["decode.speculative.method=ngram"], "decode", "--speculative-method"),
        (["decode.engine.hostCacheGib=4"], "decode", "--host-cache-gib"),
        (["prefill.engine.hostCacheGib=4"], "prefill", "--host-cache-gib"),
    ],
    ids=["kv-int8", "speculative", "host-tier", "prefill-host-tier"],
)
def test_the_schema_refuses_what_the_workers_would_refuse_at_start(
    helm: str, values: list[str], role: str, refused: str
) -> None:
    """Past the schema, the same values render and the worker refuses them at start
    (crash-looping pods): the schema's refusals are the engine's, moved to install time."""
    args = [a for v in [*VLLM_ON, *values] for a in ("--set", v)]
    manifests = render(helm, "--skip-schema-validation", *args)
    with pytest.raises(ValueError, match=refused):
        _config(manifests, role)


def test_the_default_native_engine_renders_as_before(helm: str) -> None:
    manifests = render(helm)
    for role in ROLES:
        variables = env(container(manifests, role))
        assert variables["PDSERVE_ENGINE"] == "native", role
        assert not VLLM_VARIABLES & variables.keys(), role
        assert container(manifests, role)["image"] == "ghcr.io/pdserve/pdserve:0.1.0"
    for role in ("prefill", "decode"):
        engine = _config(manifests, role).engine
        assert engine.backend is EngineBackend.NATIVE and engine.vllm == VllmOptions()
        assert _gpus(manifests, role) == {"requests": None, "limits": 1}
    # The vLLM image is the vllm backend's only: with native, setting it changes nothing.
    image = render(helm, "--set", "engine.vllm.image.tag=x", "--set", "engine.backend=native")
    for role in ROLES:
        assert container(image, role) == container(manifests, role)
    ray = find(render(helm, *RAY), "Job", "rel-pdserve-ray-up")["spec"]["template"]["spec"]
    job = ray["containers"][0]
    assert env(job)["PDSERVE_ENGINE"] == "native" and not VLLM_VARIABLES & env(job).keys()
    assert job["image"] == "ghcr.io/pdserve/pdserve:0.1.0"
