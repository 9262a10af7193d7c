"""Request traces through ``pdserve up``: one request is one trace whose spans cover the
router, the prefill worker, the KV transfer and the decode worker with parent links intact,
exported over real OTLP/gRPC to a receiver built from OpenTelemetry's own protocol; the
phases the router reports add up to the TTFT it measured."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest

from engine import SamplingParams
from pdserve.app.local_cluster import LocalCluster
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
    assert trace["decode_worker.kv_pull"].parent_id == admission.span_id
    # The trace's TTFT phases: the router's spans up to the first token, as measured.
    ttft_spans = sum(trace[n].seconds for n in router_phases[:3])
    assert abs(ttft_spans - root.attributes["pdserve.ttft_s"]) <= 0.05 * ttft_spans
    assert root.attributes["pdserve.output_tokens"] == 24
    assert root.attributes["pdserve.path"] == "disaggregated"


def test_a_speculating_decode_worker_reports_its_guesses_on_the_trace(
    llama_dir: Path, redis_url: str, tmp_path: Path, otlp_receiver: OtlpReceiver
) -> None:
    """The decode worker drafts with the target itself: greedy, every guess is kept (but for
    guesses past the end); the root span says how many were verified and kept."""
    spec = ("--speculative-method", "draft", "--spec-draft-model", str(llama_dir))
    spec += ("--num-speculative-tokens", "4")
    endpoint = otlp_receiver.endpoint
    config = traced_cluster(llama_dir, redis_url, tmp_path, endpoint, decode_args=spec)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with LocalCluster(config) as cluster:

        async def one() -> None:
            streams, tasks = await run_streams(
                cluster.address, requests_for([[3, *range(60, 80)]], [params])
            )
            await asyncio.gather(*tasks)
            assert streams[0].error is None and len(streams[0].token_ids) == 40

        asyncio.run(one())
        spans = otlp_receiver.wait(lambda got: any(s.name == "pdserve.request" for s in got))
    (root,) = [s for s in spans if s.name == "pdserve.request"]
    proposed = root.attributes["pdserve.spec_proposed_tokens"]
    accepted = root.attributes["pdserve.spec_accepted_tokens"]
    assert 0 < accepted <= proposed
    assert proposed - accepted <= 4  # at most one step's guesses past max_tokens go
    assert "pdserve.host_cached_tokens" not in root.attributes  # no host tier here
