"""Peer pull over NIXL (docs/kv-cache.md): prefill worker A pulls the prompt's cached prefix from
prefill worker B with one-sided READs (digests checked), computes only the rest, and the
decoded tokens are one engine's; nothing is held afterwards."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from engine import SamplingParams
from native_engine import LLM
from pdserve.v1 import common_pb2, prefill_pb2
from tests.services.harness import (
    both_sides_freed,
    disaggregated,
    prefill_stub,
    start_decode,
    start_prefill,
)

PROMPT = list(range(3, 300))
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_a_prefix_pulled_over_nixl_is_computed_once(
    llama_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    want = make_llm(llama_dir).generate([PROMPT], PARAMS)[0].token_ids

    async def run() -> None:
        b, b_server = await start_prefill(llama_dir, kv_backend="nixl")
        a, a_server = await start_prefill(llama_dir, kv_backend="nixl", prefill_peers=(b.address,))
        _, d_server = await start_decode(llama_dir, peers=[a_server, b_server], kv_backend="nixl")
        try:
            assert await disaggregated(b_server, d_server, PROMPT, PARAMS, "on-b") == want[1:]
            source = prefill_pb2.PrefixSource(holder_address=b.address, num_blocks=18)
            got = await disaggregated(a_server, d_server, PROMPT, PARAMS, "on-a", source)
            assert got == want[1:]
            stats = await prefill_stub(a_server).GetStats(common_pb2.GetStatsRequest())
            assert stats.num_prompt_tokens_computed == len(PROMPT) - 18 * 16
            await both_sides_freed(a_server, d_server)
            await both_sides_freed(b_server, d_server)
            assert not a.leases and not b.leases
        finally:
            for server in (d_server, a_server, b_server):
                await server.shutdown()

    asyncio.run(run())
