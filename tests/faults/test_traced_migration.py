"""A traced request whose decode worker is killed mid-stream (kill -9): its one trace shows
both attempts, the failed one's decode span marked as an error with the failure's reason, the
migration between them, and the second attempt's prefill and decode; the stream itself is
one engine's tokens."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from app.local_cluster import LocalCluster
from engine import SamplingParams
from native_engine import LLM
from tests.faults.faults_util import kill_the_busiest_decode_worker, metric
from tests.services.otlp_receiver import OtlpReceiver, ReceivedSpan, traced_cluster

pytestmark = pytest.mark.slow


def test_a_migrated_request_shows_both_attempts_in_one_trace(
    llama_dir: Path,
    redis_url: str,
    tmp_path: Path,
    otlp_receiver: OtlpReceiver,
    make_llm: Callable[..., LLM],
) -> None:
    config = traced_cluster(llama_dir, redis_url, tmp_path, otlp_receiver.endpoint, num_decode=2)
    prompt = [3, *range(40, 70)]
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    with LocalCluster(config) as cluster:
        streams, _ = asyncio.run(kill_the_busiest_decode_worker(cluster, [prompt], [params]))

        def complete(got: list[ReceivedSpan]) -> bool:
            names = [s.name for s in got]
            return "pdserve.request" in names and names.count("prefill_worker.prefill") == 2

        spans = otlp_receiver.wait(complete)
        admitted = metric(cluster.router, "pdserve_flow_admitted_total")

    (stream,) = streams
    assert stream.token_ids == make_llm(llama_dir).generate([prompt], params)[0].token_ids
    assert stream.final is not None and stream.final.num_migrations == 1
    (root,) = [s for s in spans if s.name == "pdserve.request"]
    assert root.attributes["pdserve.migrations"] == 1
    # Flow control admitted it once: the continuation kept its place, it did not queue again.
    assert admitted == 1.0
    mine = [s for s in spans if s.trace_id == root.trace_id and s.parent_id == root.span_id]
    attempts = {s.attributes["pdserve.attempt"]: [] for s in mine}
    for s in sorted(mine, key=lambda s: s.start_ns):
        attempts[s.attributes["pdserve.attempt"]].append(s.name)
    assert attempts[0] == [
        "pdserve.router",
        "pdserve.route",
        "pdserve.prefill",
        "pdserve.decode_admission",
        "pdserve.decode",
    ]
    # The continuation is prefilled again (prompt + what the client has) and decoded elsewhere.
    assert attempts[1] == [
        "pdserve.migration",
        "pdserve.route",
        "pdserve.prefill",
        "pdserve.decode_admission",
        "pdserve.decode",
    ]
    (failed,) = [s for s in mine if s.error]
    assert failed.name == "pdserve.decode" and failed.attributes["pdserve.attempt"] == 0
    (migration,) = [s for s in mine if s.name == "pdserve.migration"]
    assert migration.attributes["reason"] == failed.attributes["pdserve.failure"]
    # Each prefill's worker span is under its attempt's prefill span. The surviving decode
    # worker's admission is under the second attempt's; the killed one's unexported spans
    # died with it (a collector keeps what a process sent before kill -9).
    theirs = {s.parent_id: s for s in spans if s.trace_id == root.trace_id}
    for s in mine:
        if s.name == "pdserve.prefill":
            assert theirs[s.span_id].name == "prefill_worker.prefill"
    (second,) = [
        s for s in mine if s.name == "pdserve.decode_admission" and s.attributes["pdserve.attempt"]
    ]
    otlp_receiver.wait(lambda got: any(s.parent_id == second.span_id for s in got))
