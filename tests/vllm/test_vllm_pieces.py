"""The vLLM engine's pieces, exact values: pages as slabs (every layout vLLM 0.32 can give a
layer's cache, built by vLLM's own function; head ranges; the skipped
blocks of a local prefix hit, the refusal of others), vLLM's KV events as pdserve's hashes, and
the sampler inside vLLM (pdserve's seeded choice, whatever the batch row)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views
from vllm.v1.kv_cache_layout import KVCacheLayout as VllmLayout
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from engine.block_hash import hash_blocks, root_hash
from engine.kv_layout import KVCacheLayout
from engine.sampling import SampleRequest, filtered_probs, processed_logits, seeded_noise
from engine.sampling_params import SamplingParams
from vllm_engine.events import CachedBlocks
from vllm_engine.kv_pages import SKIP_BLOCK, PageShapeError, VllmKVPages, page_halves
from vllm_engine.sampler import EXTRA_ARGS_KEY, PdserveSampler, sampling_extra_args

LAYOUT = KVCacheLayout("fp", "float32", 4, 2, 2, 3, page_layout="vllm-test")
NUM_BLOCKS = 5


def _layers(layout: str, num_layers: int = 2, heads: int = 2) -> list[torch.Tensor]:
    """What vLLM 0.32 registers with a connector: one ``[B, H, N, C]`` view per layer of one
    allocation, strided as ``layout`` says (``create_kv_cache_views``, vLLM's own), filled."""
    spec = FullAttentionSpec(block_size=4, num_kv_heads=heads, head_size=3, dtype=torch.float32)
    order = VllmLayout[layout]
    page = spec.page_size_bytes
    # Layer-outermost: a layer is one region; block-outermost: a block holds every layer's.
    strides = (page * NUM_BLOCKS, page) if order.is_layer_compact else (page, page * num_layers)
    tensor = KVCacheTensor(
        page * NUM_BLOCKS * num_layers, [f"l{i}" for i in range(num_layers)], *strides
    )
    raw = torch.randn(page * NUM_BLOCKS * num_layers // 4).view(torch.int8)
    return create_kv_cache_views(raw, spec, NUM_BLOCKS, order, tensor)


LAYOUTS = ("LBHNC", "LBNHC", "BLHNC", "BLNHC")  # a layer's pages are contiguous in each


@pytest.mark.parametrize("layout", LAYOUTS)
def test_slabs_are_the_halves_of_each_page_and_round_trip(layout: str) -> None:
    layers = _layers(layout)
    pages = VllmKVPages(layers, LAYOUT, NUM_BLOCKS)
    data = pages.read_slabs(0, 4, [3, 1])
    assert data.shape == (4, 2, 4, 2, 3)
    halves = page_halves(layers[1], NUM_BLOCKS)[0]
    assert torch.equal(data[3, 0].flatten(), halves[3, 1])  # layer 1, second half, block 3
    page = data[2:, 0].flatten()  # layer 1, block 3: its page, in memory order
    physical = layers[1][3] if "HN" in layout else layers[1][3].transpose(0, 1)
    assert torch.equal(page, physical.flatten())
    other = VllmKVPages(_layers(layout), LAYOUT, NUM_BLOCKS)
    other.write_slabs(0, [0, 4], data)
    assert torch.equal(other.read_slabs(0, 4, [0, 4]), data)
    # A local prefix hit's block is received, not written.
    before = other.read_slabs(0, 4, [2])
    other.write_slabs(0, [SKIP_BLOCK, 2], pages.read_slabs(0, 4, [1, 4]))
    assert torch.equal(other.read_slabs(0, 4, [2]), pages.read_slabs(0, 4, [4]))
    assert not torch.equal(before, other.read_slabs(0, 4, [2]))


def test_each_layout_names_its_arrangement_and_only_heads_outermost_cut_by_heads() -> None:
    names = {lay: page_halves(_layers(lay)[0], NUM_BLOCKS, 2)[1] for lay in LAYOUTS}
    heads_outermost, tokens_outermost = "BHx4x6", "B4x2x6/NHC"
    assert names == {
        "LBHNC": heads_outermost,
        "BLHNC": heads_outermost,
        "LBNHC": tokens_outermost,
        "BLNHC": tokens_outermost,
    }
    # One head per rank: where it sits in the page is no difference.
    assert page_halves(_layers("LBNHC", heads=1)[0], NUM_BLOCKS, 1)[1] == "BHx4x6"
    for lay in ("LBHNC", "BLHNC"):  # a head range is each page's run of those heads
        layer = _layers(lay)[1]
        one = VllmKVPages(
            [layer], dataclasses.replace(LAYOUT, num_layers=1, num_kv_heads=1), NUM_BLOCKS, 1
        )
        got = one.read_slabs(0, 2, [2]).flatten()
        assert torch.equal(got, layer[2, 1].flatten())
    with pytest.raises(PageShapeError, match="not cut by heads"):
        VllmKVPages([_layers("LBNHC")[0]], LAYOUT, NUM_BLOCKS, first_head=1)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_what_nixl_registers_is_contiguous_and_holds_every_slab_where_the_spans_say(
    layout: str,
) -> None:
    pages = VllmKVPages(_layers(layout), LAYOUT, NUM_BLOCKS)
    spans = pages.spans()
    (region,) = spans.tensors  # one allocation: one region, every layer's pages in it
    assert region.is_contiguous()
    raw, start = region.view(torch.uint8), region.data_ptr()
    size = LAYOUT.slab_block_bytes
    for slab, (base, stride) in enumerate(zip(spans.bases, spans.strides, strict=True)):
        for block in range(NUM_BLOCKS):
            offset = base + block * stride - start
            assert offset >= 0 and offset + size <= raw.numel()
            want = pages.read_slabs(slab, 1, [block]).contiguous().view(torch.uint8).flatten()
            assert torch.equal(raw[offset : offset + size], want), (slab, block)


def test_a_block_split_into_kernel_blocks_is_one_page_of_them() -> None:
    """vLLM gives a backend that takes fewer tokens per block its blocks as kernel blocks, one
    after the other (``[num_blocks * ratio, H, N / ratio, C]``): a page is a block's run."""
    layer = torch.randn(2 * NUM_BLOCKS, 2, 2, 6)
    halves, name = page_halves(layer, NUM_BLOCKS, 2)
    assert name == "B2x2x2x6" and torch.equal(halves[3].flatten(), layer[6:8].flatten())


def test_pages_it_cannot_split_are_refused_by_shape() -> None:
    with pytest.raises(PageShapeError, match=r"shape \(5, 4, 6\) \(stride \(6, 30, 1\)\)"):
        page_halves(torch.zeros(4, 5, 6).transpose(0, 1), NUM_BLOCKS)


def test_vllms_events_become_pdserves_hashes_chained_by_token() -> None:
    root = root_hash("fp")
    tokens = list(range(12))
    cached = CachedBlocks(root)
    stored = BlockStored(
        block_hashes=[b"a", b"b"],
        parent_block_hash=None,
        token_ids=tokens[:8],
        block_size=4,
        lora_id=None,
        medium=None,
        lora_name=None,
    )
    child = BlockStored(
        block_hashes=[b"c"],
        parent_block_hash=b"b",
        token_ids=tokens[8:],
        block_size=4,
        lora_id=None,
        medium=None,
        lora_name=None,
    )
    orphan = BlockStored(
        block_hashes=[b"x"],
        parent_block_hash=b"unknown",
        token_ids=[1, 2, 3, 4],
        block_size=4,
        lora_id=None,
        medium=None,
        lora_name=None,
    )
    cached.apply([KVEventBatch(ts=0.0, events=[stored, child, orphan])])
    expected = hash_blocks(root, tokens, 4)
    events = cached.drain()
    assert events.stored == expected and events.removed == []
    cached.apply([KVEventBatch(ts=1.0, events=[BlockRemoved(block_hashes=[b"b"], medium=None)])])
    assert cached.drain().removed == [expected[1]]
    assert sorted(cached.hashes()) == sorted([expected[0], expected[2]])
    cached.apply([KVEventBatch(ts=2.0, events=[AllBlocksCleared()])])
    assert cached.drain().cleared and cached.hashes() == []


def _vllm_params(params: SamplingParams, offset: int):  # type: ignore[no-untyped-def]
    from vllm import SamplingParams as VllmParams

    return VllmParams(
        temperature=0.0, extra_args={EXTRA_ARGS_KEY: sampling_extra_args(params, offset, (0,))}
    )


def test_the_sampler_leaves_vllm_pdserves_seeded_choice_in_any_row() -> None:
    seeded = SamplingParams(temperature=0.7, top_k=5, seed=42)
    greedy = SamplingParams(temperature=0.0)
    logits = torch.randn(3, 50)
    sampler = PdserveSampler(None, torch.device("cpu"), False)  # type: ignore[arg-type]
    outputs: list[int] = [9, 9]  # two tokens out already, one generated elsewhere before them
    sampler.update_state(
        BatchUpdate(
            batch_size=3,
            removed=[],
            added=[
                (0, _vllm_params(greedy, 0), None, []),
                (2, _vllm_params(seeded, 1), None, outputs),
            ],
            moved=[],
        )
    )
    want = SampleRequest(seeded, 3)  # output index = offset 1 + 2 generated
    probs = filtered_probs(logits[2:3], [want])
    token = int((probs / seeded_noise(50, torch.device("cpu"), want)).argmax())
    out = sampler.apply(logits.clone())
    assert torch.equal(out[0], logits[0])  # greedy: vLLM's argmax is pdserve's
    assert int(out[2].argmax()) == token and torch.isinf(out[2]).sum() == 49
    # Moved to row 1: the same request, the same choice.
    sampler.update_state(
        BatchUpdate(
            batch_size=2, removed=[0], added=[], moved=[(2, 1, MoveDirectionality.UNIDIRECTIONAL)]
        )
    )
    out = sampler.apply(logits[[0, 2]].clone())
    assert int(out[1].argmax()) == token


def test_the_sampler_counts_a_continuations_earlier_output_as_output() -> None:
    """vLLM's prompt is the request's prompt then its earlier output (``offset`` tokens):
    penalties see the split, as the native engine does."""
    params = SamplingParams(
        temperature=0.0,
        presence_penalty=1.5,
        frequency_penalty=0.5,
        repetition_penalty=1.3,
        logit_bias={3: 2.0},
        min_tokens=4,
    )
    logits = torch.randn(1, 50)
    sampler = PdserveSampler(None, torch.device("cpu"), False)  # type: ignore[arg-type]
    outputs = [7]
    added = [(0, _vllm_params(params, 2), [1, 2, 3, 4, 0], outputs)]  # earlier output: 4, 0
    sampler.update_state(BatchUpdate(batch_size=1, removed=[], added=added, moved=[]))
    want = SampleRequest(params, 3, [1, 2, 3], [4, 0, 7], (0,))
    expected = int(processed_logits(logits, [want]).argmax())
    out = sampler.apply(logits.clone())
    assert int(out[0].argmax()) == expected and torch.isinf(out[0]).sum() == 49
    assert torch.isinf(processed_logits(logits, [want])[0, 0])  # EOS held back by min_tokens


def test_the_vllm_internals_pdserve_relies_on_are_there() -> None:
    """What docs/engines.md lists as the vLLM internals still used, checked against the
    installed vLLM: a release that moves one fails here, by name, before any cluster starts."""
    import inspect

    from vllm.distributed import parallel_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core_client import InprocClient
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.request import Request, RequestStatus

    def assigns(cls: type, *names: str) -> None:
        source = inspect.getsource(cls)
        for name in names:
            assert f"self.{name} =" in source or f"self.{name}:" in source, (cls, name)

    assigns(LLMEngine, "engine_core")
    assigns(InprocClient, "engine_core")
    assigns(Scheduler, "running", "kv_cache_config", "kv_cache_manager", "kv_event_publisher")
    assert callable(Scheduler.get_request_counts)
    assigns(BlockPool, "num_gpu_blocks")
    assert callable(BlockPool.get_num_free_blocks)
    assigns(Request, "kv_transfer_params")
    assert RequestStatus.FINISHED_LENGTH_CAPPED
    for hook in ("update_connector_output", "get_transfer_results", "register_kv_caches"):
        assert callable(getattr(KVConnectorBase_V1, hook)), hook
    assert parallel_state.get_tensor_model_parallel_rank
    assert parallel_state.get_tensor_model_parallel_world_size
    # Unequal tensor parallelism cuts CPU pages by heads: block-major, heads outermost.
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.kv_cache_layout import KVCacheLayout as VllmCacheLayout

    assert CPUAttentionBackend.supported_kv_cache_layouts() == (VllmCacheLayout.LBHNC,)


def test_what_an_engine_core_in_its_own_process_is_driven_through_is_there() -> None:
    """``--engine-core process`` (vllm_engine/process_core.py) uses vLLM's public client and
    its stat logger, stats and event interfaces only; the fields it reads are checked here."""
    import dataclasses
    import inspect

    import msgspec
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import StatLoggerBase
    from vllm.v1.metrics.stats import SchedulerStats

    for method in ("add_request", "abort", "shutdown", "from_vllm_config"):
        assert callable(getattr(AsyncLLM, method)), method
    assert isinstance(inspect.getattr_static(AsyncLLM, "errored"), property)
    assert isinstance(inspect.getattr_static(AsyncLLM, "dead_error"), property)
    assert "stat_loggers" in inspect.signature(AsyncLLM.from_vllm_config).parameters
    record = inspect.signature(StatLoggerBase.record).parameters
    assert list(record)[:3] == ["self", "scheduler_stats", "iteration_stats"]
    fields = {f.name for f in dataclasses.fields(SchedulerStats)}
    assert {"num_running_reqs", "num_waiting_reqs", "num_skipped_waiting_reqs"} <= fields
    assert "kv_cache_usage" in fields
    # The publisher's frames: (topic, 8-byte big-endian sequence, msgpack KVEventBatch).
    assert 'seq.to_bytes(8, "big")' in inspect.getsource(ZmqEventPublisher)
    stored = BlockStored([b"h"], None, [1, 2], 2, None, None, None)
    batch = KVEventBatch(ts=1.0, events=[stored])
    decoded = msgspec.msgpack.Decoder(type=KVEventBatch).decode(
        msgspec.msgpack.Encoder().encode(batch)
    )
    assert decoded.events[0].token_ids == [1, 2]


def test_model_runner_v2_is_refused_by_the_variable_that_chooses_it(
    vllm_model,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA vLLM 0.32 defaults to Model Runner V2, whose logits processors are not the
    interface pdserve's sampler implements: pdserve asks for the V1 runner (the variable at 0
    unless the operator set it), and V2 chosen all the same is refused by name before the
    model loads (vllm_engine/builder.py). This CPU build has no Triton, so vLLM itself refuses
    V2 here; a GPU check (scripts/gpu_check.sh) starts on CUDA."""
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

    from vllm_engine.builder import V2_RUNNER_VARIABLE, check_model_runner

    assert isinstance(VllmConfig.__dict__["use_v2_model_runner"], property)
    monkeypatch.setenv(V2_RUNNER_VARIABLE, "1")
    with pytest.raises(ValueError, match=r"VLLM_USE_V2_MODEL_RUNNER='1'.*set it to 0"):
        check_model_runner(True)
    monkeypatch.setenv(V2_RUNNER_VARIABLE, "0")
    config = EngineArgs(model=str(vllm_model("llama")), block_size=32).create_engine_config()
    assert not config.use_v2_model_runner
    check_model_runner(config.use_v2_model_runner)


def test_nothing_in_vllms_environment_provides_one_of_our_top_level_names() -> None:
    from tests.unit.test_layering import foreign_owners_of_our_names

    assert foreign_owners_of_our_names() == {}
