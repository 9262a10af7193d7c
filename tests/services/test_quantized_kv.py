"""A quantized KV cache across services, on real gRPC and Redis: an int8 cluster (router,
prefill and decode workers all int8) answers exactly as one int8 engine does; a worker whose
cache dtype differs is refused by the router (its fingerprint differs). A decode worker that
pulls from a sender of another cache dtype: tests/services/test_transfer_failures.py."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from pathlib import Path

import grpc

from app.client import generate
from engine import SamplingParams
from engine.kv_layout import KVCacheDtype
from engine.model_layout import ModelLayout
from native_engine import LLM
from pdserve.cluster.config import RedisConfig
from pdserve.common.convert import sampling_to_proto
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from router.config import RouterConfig
from router.service import RouterService
from tests.services.harness import (
    prefill_stub,
    start,
    start_decode,
    start_prefill,
)

INT8 = KVCacheDtype.INT8
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=4, ignore_eos=True)


def test_an_int8_cluster_answers_as_one_int8_engine_and_refuses_other_dtypes(
    llama_dir: Path, redis_url: str, make_llm: Callable[..., LLM]
) -> None:
    prompts = [list(range(30, 30 + n)) for n in (20, 47, 70)]
    colocated = make_llm(llama_dir, kv_cache_dtype="int8")
    references = {
        (i, p.seed): out
        for p in (PARAMS, SEEDED)
        for i, out in enumerate(colocated.generate(prompts, p))
    }

    async def run() -> None:
        redis = RedisConfig(url=redis_url, namespace=f"q-{uuid.uuid4().hex[:8]}")
        _, full_prefill = await start_prefill(llama_dir, redis=redis)  # auto: refused
        _, int8_prefill = await start_prefill(llama_dir, redis=redis, kv_cache_dtype=INT8)
        _, int8_decode = await start_decode(llama_dir, redis=redis, kv_cache_dtype=INT8)
        service = RouterService(
            RouterConfig(
                model=str(llama_dir),
                redis=redis,
                layout=ModelLayout(kv_cache_dtype=INT8),
                local_prefill_tokens=0,
            )
        )
        router = await start(service)
        try:
            await service.dispatch.cluster.discover()  # a pass that saw all three workers
            assert set(service.pool.prefill) == {int8_prefill.address}
            assert set(service.pool.decode) == {int8_decode.address}
            async with grpc.aio.insecure_channel(router.address) as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                for (i, seed), ref in references.items():
                    params = PARAMS if seed is None else SEEDED
                    request = router_pb2.GenerateRequest(
                        prompt_token_ids=prompts[i], sampling=sampling_to_proto(params)
                    )
                    result = await generate(stub, request)
                    assert result.token_ids == ref.token_ids, (i, seed)
            full_stats = await prefill_stub(full_prefill).GetStats(common_pb2.GetStatsRequest())
            assert full_stats.num_prompt_tokens_computed == 0  # never chosen
        finally:
            await router.shutdown()
            for server in (int8_decode, int8_prefill, full_prefill):
                await server.shutdown()

    asyncio.run(run())
