"""``pdserve up --control-port`` with the cluster's ``--tls-*``: the pools' control RPC takes
only callers with a certificate from the cluster's CA (before, it was plaintext whatever the
cluster's TLS, so anyone reaching the port could resize the pools)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from app.capacity.scale_target import LocalTarget
from app.cluster_control import serve_control
from app.local_cluster import ClusterConfig, LocalCluster
from pdserve.common.role import Role
from pdserve.common.tls import TlsConfig
from tests.security.tls_util import make_pki


def test_the_control_port_takes_only_the_clusters_certificates(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    cluster = LocalCluster(ClusterConfig(model=str(tmp_path)))  # not started: no workers
    tls = TlsConfig(str(pki.cert), str(pki.key), str(pki.ca))
    server, port = serve_control(cluster, "127.0.0.1", 0, tls)
    try:
        address = f"127.0.0.1:{port}"
        assert LocalTarget(address, tls=tls).replicas(Role.DECODE) == 0
        with pytest.raises(grpc.RpcError) as plaintext:
            LocalTarget(address).replicas(Role.DECODE)
        assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE
        rogue = TlsConfig(str(pki.rogue_cert), str(pki.rogue_key), str(pki.ca))
        with pytest.raises(grpc.RpcError) as stranger:
            LocalTarget(address, tls=rogue).replicas(Role.DECODE)
        assert stranger.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(grace=None)
