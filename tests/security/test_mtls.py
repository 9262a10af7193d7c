"""Mutual TLS between the services: the whole path works with TLS on (output of one engine),
while a client without a certificate from the cluster's CA, or with one from another CA, can
call no internal RPC and pull no KV. The router's public port serves TLS to clients that
present no certificate."""

from __future__ import annotations

import asyncio
import os
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx2
import pytest

from app.client import generate, router_channel
from app.local_cluster import ClusterConfig, LocalCluster
from engine import SamplingParams
from native_engine import LLM
from pdserve.common.convert import sampling_to_proto
from pdserve.v1 import (
    common_pb2,
    decode_pb2_grpc,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from tests.security.tls_util import Pki, make_pki

pytestmark = pytest.mark.slow
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def cluster(
    llama_dir: Path, pki: Pki, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    config = ClusterConfig(
        model=str(llama_dir),
        log_dir=tmp_path_factory.mktemp("logs"),
        prefill_args=pki.flags(),
        decode_args=pki.flags(),
        router_args=(*pki.flags(), "--local-prefill-tokens", "0"),
        router_http_port=0,
    )
    with LocalCluster(config) as c:
        yield c


def test_the_whole_path_runs_over_mutual_tls(
    cluster: LocalCluster, pki: Pki, llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    prompts = [list(range(5, 5 + n)) for n in (20, 70, 130)]
    reference = make_llm(llama_dir).generate(prompts, PARAMS)

    async def run() -> list[list[int]]:
        async with router_channel(cluster.address, tls_ca=str(pki.ca)) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            results = []
            for prompt in prompts:
                request = router_pb2.GenerateRequest(
                    prompt_token_ids=prompt, sampling=sampling_to_proto(PARAMS)
                )
                results.append((await generate(stub, request)).token_ids)
            return results

    assert asyncio.run(run()) == [r.token_ids for r in reference]
    decode = cluster.decode[0]
    assert asyncio.run(_stats_over_tls(decode.address, pki)).num_prompt_tokens_computed == 0


async def _stats_over_tls(address: str, pki: Pki) -> common_pb2.WorkerStats:
    credentials = grpc.ssl_channel_credentials(
        pki.ca.read_bytes(), pki.key.read_bytes(), pki.cert.read_bytes()
    )
    options = [("grpc.ssl_target_name_override", "pdserve")]
    async with grpc.aio.secure_channel(address, credentials, options=options) as channel:
        stub = decode_pb2_grpc.DecodeWorkerStub(channel)
        return await stub.GetStats(common_pb2.GetStatsRequest(), timeout=10)


def _channels(address: str, pki: Pki) -> dict[str, grpc.aio.Channel]:
    """Every way in but the right one: plaintext, TLS without a client certificate, and a
    certificate from another CA."""
    ca = pki.ca.read_bytes()
    options = [("grpc.ssl_target_name_override", "pdserve")]
    rogue = grpc.ssl_channel_credentials(
        ca, pki.rogue_key.read_bytes(), pki.rogue_cert.read_bytes()
    )
    return {
        "plaintext": grpc.aio.insecure_channel(address),
        "no client certificate": grpc.aio.secure_channel(
            address, grpc.ssl_channel_credentials(ca), options=options
        ),
        "another CA's certificate": grpc.aio.secure_channel(address, rogue, options=options),
    }


def test_internal_ports_refuse_clients_without_the_cluster_certificate(
    cluster: LocalCluster, pki: Pki
) -> None:
    prefill, decode = cluster.prefill[0], cluster.decode[0]

    async def run() -> None:
        # The KV address, asked the right way.
        credentials = grpc.ssl_channel_credentials(
            pki.ca.read_bytes(), pki.key.read_bytes(), pki.cert.read_bytes()
        )
        options = [("grpc.ssl_target_name_override", "pdserve")]
        async with grpc.aio.secure_channel(prefill.address, credentials, options=options) as ch:
            stub = prefill_pb2_grpc.PrefillWorkerStub(ch)
            kv = (await stub.GetStats(common_pb2.GetStatsRequest(), timeout=10)).kv_address
        for target, call in (
            (prefill.address, "prefill"),
            (decode.address, "decode"),
            (kv, "kv"),
        ):
            for how, channel in _channels(target, pki).items():
                async with channel:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        if call == "prefill":
                            await prefill_pb2_grpc.PrefillWorkerStub(channel).GetStats(
                                common_pb2.GetStatsRequest(), timeout=5
                            )
                        elif call == "decode":
                            await decode_pb2_grpc.DecodeWorkerStub(channel).GetStats(
                                common_pb2.GetStatsRequest(), timeout=5
                            )
                        else:
                            stream = kv_transfer_pb2_grpc.KVTransferStub(channel).Pull(
                                kv_transfer_pb2.PullRequest(request_id="x"), timeout=5
                            )
                            await stream.read()
                    assert err.value.code() in (
                        grpc.StatusCode.UNAVAILABLE,
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                    ), f"{call} via {how}: {err.value}"

    asyncio.run(run())


def test_the_openai_api_serves_https_with_the_same_certificate(
    cluster: LocalCluster, pki: Pki
) -> None:
    assert cluster.router is not None
    base = f"https://{cluster.router.http_address}"
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    verify = ssl.create_default_context(cafile=str(pki.ca))
    r = httpx2.post(f"{base}/v1/completions", json=body, verify=verify, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    with pytest.raises(httpx2.HTTPError):  # plaintext to the TLS port: no answer
        httpx2.post(f"http://{cluster.router.http_address}/v1/completions", json=body, timeout=10)


def test_requests_keep_working_across_a_certificate_renewal(
    cluster: LocalCluster, pki: Pki, llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    """cert-manager renews the files in place: the services' channels move to the new
    certificate (the decode worker's at its next lease release, its KV receiver's at its next
    pull) while requests keep their exact output. The router's part: test_cert_rotation.py."""
    prompt = list(range(9, 40))
    reference = make_llm(llama_dir).generate([prompt], PARAMS)[0].token_ids

    async def run() -> int:
        async with router_channel(cluster.address, tls_ca=str(pki.ca)) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            request = router_pb2.GenerateRequest(
                prompt_token_ids=prompt, sampling=sampling_to_proto(PARAMS)
            )
            assert (await generate(stub, request)).token_ids == reference
            # The renewal: the same files, a later modification time (the services recheck
            # every second, on their next call).
            for path in (pki.cert, pki.key):
                later_ns = path.stat().st_mtime_ns + 1_000_000_000
                os.utime(path, ns=(later_ns, later_ns))
            renewed = time.monotonic()
            num_requests = 0
            # Past the recheck interval, then two more: requests both sides of the retirement.
            while time.monotonic() - renewed < 3.0 or num_requests < 3:
                assert (await generate(stub, request)).token_ids == reference
                num_requests += 1
            for _ in range(2):
                assert (await generate(stub, request)).token_ids == reference
            return num_requests + 2

    assert asyncio.run(run()) >= 5
