"""An int8 KV cache on every component of a disaggregated cluster (``pdserve up`` processes),
and a decode worker killed mid-stream: every stream, greedy and seeded, still gives one int8
engine's tokens. The replay prefills prompt + delivered tokens again (int8, on the prefill
pool), and since each token's codes and scale depend only on its own K/V, the survivor continues
from what the dead worker held. Nothing is held afterwards."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from app.local_cluster import LocalCluster
from native_engine import LLM
from tests.faults.faults_util import kill_a_decode_worker_mid_stream, metric, two_decode_workers

pytestmark = pytest.mark.slow


def test_int8_decode_pool_killed_mid_stream_every_stream_is_one_int8_engines(
    llama_dir: Path, redis_url: str, tmp_path: Path, make_llm: Callable[..., LLM]
) -> None:
    int8 = ("--kv-cache-dtype", "int8")
    config = two_decode_workers(
        llama_dir, redis_url, tmp_path, prefill_args=int8, decode_args=int8, router_args=int8
    )
    prompts = [[3 + i, *range(60, 60 + 12 + 2 * i)] for i in range(8)]
    with LocalCluster(config) as cluster:
        llm = make_llm(llama_dir, kv_cache_dtype="int8")
        victim = kill_a_decode_worker_mid_stream(cluster, prompts, llm, 200)
        (survivor,) = [c for c in cluster.decode if c.name != victim.name]
        # The replays were prefilled (int8) by the prefill pool and pulled by the survivor.
        (prefill,) = cluster.prefill
        replayed = metric(prefill, "pdserve_prompt_tokens_computed") - sum(map(len, prompts))
        assert replayed > 0
        assert metric(survivor, "pdserve_prompt_tokens_computed") == 0
        # The operator sees the cache's cost per token, by dtype.
        layout = llm.engine.kv_layout
        per_token = metric(survivor, "pdserve_kv_cache_bytes_per_token", 'kv_cache_dtype="int8"')
        assert per_token == layout.block_bytes / layout.block_size
