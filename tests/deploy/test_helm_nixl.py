"""The chart with ``kvTransfer.backend: nixl``: UCX's pinned TCP ports opened between the
release's workers only, a memory-backed /dev/shm, RDMA devices requested, the flags passed."""

from __future__ import annotations

import subprocess

from tests.deploy.test_helm_chart import CHART, _flags, env, find, helm, pod_spec, render

__all__ = ["helm"]  # the session fixture, shared with the chart's other tests


def test_nixl_opens_the_ucx_ports_and_mounts_shared_memory(helm: str) -> None:
    manifests = render(helm, "-f", str(CHART / "ci" / "nixl-values.yaml"))
    for role in ("prefill", "decode"):
        spec = pod_spec(manifests, role)
        c = spec["containers"][0]
        variables = env(c)
        assert variables["PDSERVE_KV_BACKEND"] == "nixl"
        assert variables["PDSERVE_UCX_TLS"] == "rc,cuda_copy,cuda_ipc,tcp"
        assert variables["PDSERVE_KV_VERIFY"] == "off"
        assert variables["UCX_TCP_PORT_RANGE"] == "50300-50331"
        # The pool's own limits kept, the RDMA device added.
        limits = c["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1 and limits["rdma/rdma_shared_device_a"] == 1
        assert (
            limits["memory"]
            == pod_spec(render(helm), role)["containers"][0]["resources"]["limits"]["memory"]
        )
        (dshm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
        assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        # UCX's pinned TCP range, from this release's pods only, next to the gRPC port.
        peers = find(manifests, "NetworkPolicy", f"rel-pdserve-{role}")["spec"]["ingress"][0]
        ucx = [p for p in peers["ports"] if p.get("endPort")]
        assert ucx == [{"port": 50300, "endPort": 50331, "protocol": "TCP"}]
    # Both pools run the same flags, so --kv-verify and --ucx-tls are real flags of both.
    for role in ("prefill", "decode"):
        assert {"PDSERVE_UCX_TLS", "PDSERVE_KV_VERIFY"} <= _flags(role)
    # The default (grpc) renders none of it.
    default = render(helm)
    for role in ("prefill", "decode"):
        spec = pod_spec(default, role)
        assert "UCX_TCP_PORT_RANGE" not in env(spec["containers"][0])
        assert not [v for v in spec["volumes"] if v["name"] == "dshm"]
    bad = subprocess.run(
        [helm, "template", "rel", str(CHART), "--set", "kvTransfer.nixl.tcpPortRange=50300"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert bad.returncode != 0 and "tcpPortRange" in bad.stderr
    reversed_range = subprocess.run(
        [helm, "template", "rel", str(CHART), "-f", str(CHART / "ci" / "nixl-values.yaml"),
         "--set", "kvTransfer.nixl.tcpPortRange=60000-50000"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert reversed_range.returncode != 0
    assert 'tcpPortRange "60000-50000": want first-last' in reversed_range.stderr
