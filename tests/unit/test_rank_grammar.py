"""A rank's grammar compiler is filled before vLLM's step needs it: the front-end's ``RankHub``
asks every rank to ``Compile`` a guided request's grammar (``vllm_engine/rank_runtime.py``, off
the rank's step), so its sampler finds it compiled. Two real rank runtimes, each with its own
compiler as a rank process has, over real gRPC on Unix sockets, on the tiny model's tokenizer."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest
import torch

from engine.guide import GuideCompiler
from engine.kv_layout import KVCacheLayout
from engine.structured_output import StructuredKind, StructuredOutput
from vllm_engine.kv_pages import VllmKVPages
from vllm_engine.rank_hub import RankHub
from vllm_engine.rank_runtime import RankRuntime

SCHEMA = StructuredOutput(
    StructuredKind.JSON_SCHEMA,
    json.dumps({"type": "object", "properties": {"id": {"type": "integer"}}}),
    "response_format",
)
BROKEN = StructuredOutput(StructuredKind.REGEX, "(unclosed", "guided_regex")
VOCAB, EOS = 1024, (2,)


def _pages(tp_rank: int) -> VllmKVPages:
    layout = KVCacheLayout(
        model_fingerprint="fp",
        dtype="float32",
        block_size=4,
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
        page_layout="vllm-test/CPU_ATTN/BHx8x8",
        tp_size=2,
        tp_rank=tp_rank,
    )
    return VllmKVPages([torch.zeros(2, 1, 8, 8)], layout, 2)


def test_every_rank_compiles_a_grammar_before_its_request_and_refuses_a_broken_one(
    llama_dir: Path,
) -> None:
    compilers = [GuideCompiler(llama_dir, VOCAB, EOS) for _ in range(2)]  # one per process

    async def run() -> None:
        hub = RankHub(2)
        await hub.start()
        ranks = [
            RankRuntime(_pages(r), r, hub.address, hub.socket_dir, compilers[r]) for r in range(2)
        ]
        try:
            await asyncio.gather(*(asyncio.to_thread(rank.start) for rank in ranks))
            await hub.wait_ranks(10.0)
            await hub.compile(SCHEMA)
            await hub.compile(SCHEMA)  # cached: compiled once per rank
            assert [c.num_compiled for c in compilers] == [1, 1]
            # What the rank's sampler does in vLLM's step: the grammar is there.
            guide = compilers[1].guide(SCHEMA, [])
            assert guide.masks((), 1).shape == (1, VOCAB)
            assert [c.num_compiled for c in compilers] == [1, 1]
            with pytest.raises(ValueError, match="guided_regex cannot be compiled"):
                await hub.compile(BROKEN)
        finally:
            for rank in ranks:
                await asyncio.to_thread(rank.close)
            await hub.close()

    asyncio.run(run())


def test_a_rank_without_a_compiler_refuses_by_name(llama_dir: Path) -> None:
    async def run() -> None:
        hub = RankHub(2)  # one of its two ranks is enough
        await hub.start()
        rank = RankRuntime(_pages(0), 0, hub.address, hub.socket_dir)
        try:
            await asyncio.to_thread(rank.start)
            with pytest.raises(grpc.aio.AioRpcError, match="samples no grammar") as refused:
                await hub.compile(SCHEMA)
            assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        finally:
            await asyncio.to_thread(rank.close)
            await hub.close()

    asyncio.run(run())
