"""Request traces through ``pdserve up``: one request is one trace whose spans cover the
router, the prefill worker, the KV transfer and the decode worker with parent links intact,
exported over real OTLP/gRPC to a receiver built from OpenTelemetry's own protocol; the
phases the router reports add up to the TTFT it measured."""

from __future__ import annotations

import asyncio
import itertools
import random
from pathlib import Path

import pytest

from app.local_cluster import LocalCluster
from engine import SamplingParams
from tests.faults.faults_util import requests_for, run_streams
from tests.services.otlp_receiver import OtlpReceiver, ReceivedSpan, traced_cluster

pytestmark = pytest.mark.slow
TTFT_PHASES = ("router", "route", "prefill_queue", "prefill_compute", "prefill_rpc")


def by_name(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    names = [s.name for s in spans]
    assert len(names) == len(set(names)), f"a span twice in one attempt: {sorted(names)}"
    return {s.name: s for s in spans}


def test_one_request_is_one_trace_across_router_prefill_transfer_and_decode(
    llama_dir: Path, redis_url: str, tmp_path: Path, otlp_receiver: OtlpReceiver
) -> None:
    config = traced_cluster(llama_dir, redis_url, tmp_path, otlp_receiver.endpoint)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LocalCluster(config) as cluster:

        async def one() -> None:
            streams, tasks = await run_streams(
                cluster.address, requests_for([[3, *range(40, 100)]], [params])
            )
            await asyncio.gather(*tasks)
            final = streams[0].final
            assert streams[0].error is None and final is not None
            phases = dict(final.timings.phases)
            ttft = sum(phases[p] for p in TTFT_PHASES)
            assert abs(ttft - final.timings.ttft_s) <= 0.05 * final.timings.ttft_s, phases
            assert set(phases) == {*TTFT_PHASES, "decode_admission", "kv_transfer", "decode"}
            assert phases["prefill_compute"] > 0 and phases["kv_transfer"] > 0

        asyncio.run(one())
        wanted = {"pdserve.request", "prefill_worker.prefill", "decode_worker.admission"}
        wanted.add("prefill_worker.kv_send")
        spans = otlp_receiver.wait(lambda got: wanted <= {s.name for s in got})

    (root,) = [s for s in spans if s.name == "pdserve.request"]
    trace = by_name([s for s in spans if s.trace_id == root.trace_id])
    assert len({s.trace_id for s in spans}) == 1  # one request, one trace
    assert root.service == "pdserve-router" and root.parent_id == ""
    router_phases = ["pdserve.router", "pdserve.route", "pdserve.prefill"]
    router_phases += ["pdserve.decode_admission", "pdserve.decode"]
    for name in router_phases:
        assert trace[name].parent_id == root.span_id and trace[name].service == "pdserve-router"
    # Contiguous, in order, from the root's start to its end.
    for before, after in itertools.pairwise(router_phases):
        assert trace[before].end_ns == trace[after].start_ns
    assert trace["pdserve.router"].start_ns == root.start_ns
    assert trace["pdserve.decode"].end_ns == root.end_ns
    # The workers' spans hang under the router's span of the call they served.
    prefill = trace["prefill_worker.prefill"]
    assert prefill.service == "pdserve-prefill"
    assert prefill.parent_id == trace["pdserve.prefill"].span_id
    assert trace["prefill_worker.queue"].parent_id == prefill.span_id
    assert trace["prefill_worker.compute"].parent_id == prefill.span_id
    admission = trace["decode_worker.admission"]
    assert admission.service == "pdserve-decode"
    assert admission.parent_id == trace["pdserve.decode_admission"].span_id
    pull = trace["decode_worker.kv_pull"]
    assert pull.parent_id == admission.span_id
    assert trace["decode_worker.allocate"].parent_id == admission.span_id
    # The KV pull carried the context on to the prefill worker's sender.
    send = trace["prefill_worker.kv_send"]
    assert send.service == "pdserve-prefill" and send.parent_id == pull.span_id
    assert send.attributes["pdserve.kv_backend"] == "grpc"
    assert send.attributes["pdserve.kv_blocks"] == admission.attributes["pdserve.kv_blocks"]
    # The trace's TTFT phases: the router's spans up to the first token, as measured.
    ttft_spans = sum(trace[n].seconds for n in router_phases[:3])
    assert abs(ttft_spans - root.attributes["pdserve.ttft_s"]) <= 0.05 * ttft_spans
    assert root.attributes["pdserve.output_tokens"] == 24
    assert root.attributes["pdserve.path"] == "disaggregated"


def test_speculation_and_host_tier_hits_are_counted_on_the_trace(
    llama_dir: Path, redis_url: str, tmp_path: Path, otlp_receiver: OtlpReceiver
) -> None:
    """The decode worker drafts with the target itself: greedy, every guess is kept (but for
    guesses past the end); the root span says how many were verified and kept. The prefill
    worker's small device cache spills a prefix to its host tier; a prompt that shares it
    loads it from there, and its trace says how many tokens."""
    spec = ("--speculative-method", "draft", "--spec-draft-model", str(llama_dir))
    spec += ("--num-speculative-tokens", "4")
    tiered = ("--num-blocks", "12", "--host-cache-gib", "0.05")
    endpoint = otlp_receiver.endpoint
    config = traced_cluster(
        llama_dir, redis_url, tmp_path, endpoint, decode_args=spec, prefill_args=tiered
    )
    rng = random.Random(3)
    prefix = [rng.randrange(3, 1024) for _ in range(64)]  # 4 blocks
    fillers = [[rng.randrange(3, 1024) for _ in range(150)] for _ in range(2)]  # 10 blocks each
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with LocalCluster(config) as cluster:

        async def one(prompt: list[int], params: SamplingParams) -> list[int]:
            streams, tasks = await run_streams(cluster.address, requests_for([prompt], [params]))
            await asyncio.gather(*tasks)
            assert streams[0].error is None, streams[0].error
            return streams[0].token_ids

        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        assert len(asyncio.run(one([3, *range(60, 80)], params))) == 40
        for prompt in ([*prefix, 7], *fillers, [*prefix, 8]):  # one at a time: in this order
            asyncio.run(one(prompt, short))
        spans = otlp_receiver.wait(
            lambda got: (
                sum(s.name == "pdserve.request" for s in got) == 5
                and sum(s.name == "prefill_worker.prefill" for s in got) == 5
            )
        )
    roots = sorted((s for s in spans if s.name == "pdserve.request"), key=lambda s: s.start_ns)
    proposed = roots[0].attributes["pdserve.spec_proposed_tokens"]
    accepted = roots[0].attributes["pdserve.spec_accepted_tokens"]
    assert 0 < accepted <= proposed
    assert proposed - accepted <= 4  # at most one step's guesses past max_tokens go
    # Only the last prompt found its prefix in the host tier: all 4 of its full blocks.
    hits = [r.attributes.get("pdserve.host_cached_tokens", 0) for r in roots]
    assert hits == [0, 0, 0, 0, 64], hits
    (prefill,) = [
        s for s in spans if s.name == "prefill_worker.prefill" and s.trace_id == roots[-1].trace_id
    ]
    assert prefill.attributes["pdserve.host_cached_tokens"] == 64
