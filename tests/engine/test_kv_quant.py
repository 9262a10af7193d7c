"""Quantized KV cache (int8, fp8_e4m3): codes plus a float32 scale per token and kv head.

What must hold: the codes and scales are exact functions of each token's own K/V (so chunked
prefill, prefix hits, speculation and transfers never change a result); the torch path, the
native CPU kernel and the Triton kernels read back the same values and give the same tokens;
and greedy decoding stays close to the full-precision cache (a measured, documented floor).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from engine.config import CacheConfig
from engine.fingerprint import fingerprint_of
from engine.kv_layout import KVCacheDtype, KVCacheLayout
from native_engine import LLM
from native_engine.diagnostics import first_difference, teacher_forced_agreement
from native_engine.kernels import triton_available
from native_engine.kv_quant import codebook, dequantize, quantize, slot_positions, store_quantized
from pdserve.common.convert import layout_from_proto, layout_to_proto, remote_layout_mismatch
from tests.identical import compare_outputs

QUANTIZED = [KVCacheDtype.INT8, KVCacheDtype.FP8_E4M3]
GREEDY_64 = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
_RNG = random.Random(3)
PROMPTS = [[_RNG.randrange(1024) for _ in range(n)] for n in (5, 23, 40)] + [[7, 8, 9, 10] * 8]
# Teacher-forced greedy agreement with the full-precision cache over 64 positions, per prompt,
# on the tiny random checkpoints (whose logits are nearly flat: the hardest case). Measured
# (docs/engine.md "Quantized KV cache"): int8 >= 0.96, fp8 >= 0.89 on every arch and prompt.
AGREEMENT_FLOOR = {KVCacheDtype.INT8: 0.9, KVCacheDtype.FP8_E4M3: 0.75}
# The largest |logit - full-precision logit| at those positions (measured: int8 <= 0.33, fp8
# <= 1.6; the tiny models' logits span about +-10).
LOGIT_ERROR_LIMIT = {KVCacheDtype.INT8: 0.5, KVCacheDtype.FP8_E4M3: 3.0}


def test_int8_codes_and_scales_exact_values() -> None:
    x = torch.tensor([[[1.0, -2.0, 0.5, 4.0]], [[0.0, 0.0, 0.0, 0.0]]])  # [2 tokens, 1 head, 4]
    codes, scales = quantize(x, KVCacheDtype.INT8)
    assert scales.tolist() == [[pytest.approx(4.0 / 127)], [1.0]]  # an all-zero row keeps 1
    # 31.75 -> 32, -63.5 -> -64 (half to even), 15.875 -> 16, 127.
    assert codes.view(torch.int8).tolist() == [[[32, -64, 16, 127]], [[0, 0, 0, 0]]]
    back = dequantize(codes, scales, KVCacheDtype.INT8, torch.float32)
    assert (back - x).abs().max() <= 4.0 / 254 + 1e-7  # half a step


def test_fp8_codes_round_trip_representable_values() -> None:
    x = torch.tensor([[[448.0, -1.0, 0.0, 0.015625]]])  # scale 1: each value is an e4m3 value
    codes, scales = quantize(x, KVCacheDtype.FP8_E4M3)
    assert scales.tolist() == [[1.0]]
    assert codes.tolist() == [[[0x7E, 0xB8, 0x00, 0x08]]]
    assert torch.equal(dequantize(codes, scales, KVCacheDtype.FP8_E4M3, torch.float32), x)
    book = codebook(KVCacheDtype.FP8_E4M3, torch.device("cpu"))
    assert book.isnan().nonzero().flatten().tolist() == [0x7F, 0xFF]  # never stored (clamped)


@pytest.mark.parametrize("kind", QUANTIZED)
def test_the_kernels_codebook_is_what_the_torch_path_decodes(kind: KVCacheDtype) -> None:
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None]  # [256 codes, 1]
    book = codebook(kind, torch.device("cpu"))
    decoded = dequantize(every, torch.ones(256), kind, torch.float32)[:, 0]
    assert torch.equal(decoded.nan_to_num(7.0), book.nan_to_num(7.0))


@pytest.mark.parametrize("kind", QUANTIZED)
def test_a_tokens_bytes_do_not_depend_on_its_batch(kind: KVCacheDtype) -> None:
    """Stored all at once, or one token at a time in another order: the same bytes."""
    gen = torch.Generator().manual_seed(0)
    key, value = torch.randn(2, 20, 2, 8, generator=gen) * torch.rand(20, 2, 1, generator=gen)
    slots = torch.randperm(32, generator=gen)[:20]

    def empty() -> list[torch.Tensor]:
        return [torch.zeros(4, 8, 2, 8, dtype=torch.uint8) for _ in range(2)] + [
            torch.zeros(4, 8, 2) for _ in range(2)
        ]

    together, apart = empty(), empty()
    store_quantized(key, value, *together, slot_positions(slots, 8), kind)  # type: ignore[misc]
    for i in reversed(range(20)):
        one = slot_positions(slots[i : i + 1], 8)
        store_quantized(key[i : i + 1], value[i : i + 1], *apart, one, kind)  # type: ignore[misc]
    assert all(torch.equal(a, b) for a, b in zip(together, apart, strict=True))


def test_layout_bytes_alignment_proto_and_fingerprint(llama_dir: Path) -> None:
    full = KVCacheLayout("fp", "bfloat16", 16, 30, 3, 64)
    int8 = KVCacheLayout("fp", "bfloat16", 16, 30, 3, 64, KVCacheDtype.INT8)
    assert int8.slab_block_bytes == 16 * 3 * 64 + 16 * 3 * 4  # codes, then scales
    assert int8.block_bytes / full.block_bytes == pytest.approx(68 / 128)  # <= 0.55
    with pytest.raises(ValueError, match="divisible by 4"):
        KVCacheLayout("fp", "float32", 1, 1, 1, 6, KVCacheDtype.INT8)
    assert layout_from_proto(layout_to_proto(int8)) == int8
    bad = layout_to_proto(int8)
    bad.kv_cache_dtype = "int4"
    mismatch = remote_layout_mismatch(int8, bad)
    assert mismatch is not None and "'int4' is not one of auto, int8, fp8_e4m3" in mismatch
    prints = {fingerprint_of(llama_dir, "float32", 16, kind) for kind in KVCacheDtype}
    assert len(prints) == 3  # distinct block-hash roots: quantized blocks never hash alike
    assert fingerprint_of(llama_dir, "float32", 16) == fingerprint_of(
        llama_dir, "float32", 16, KVCacheDtype.AUTO
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("kind", QUANTIZED)
def test_greedy_agreement_with_full_precision(
    arch: str, kind: KVCacheDtype, model_factory: Callable[..., Path], make_llm: Callable[..., LLM]
) -> None:
    model = model_factory(arch)
    full = make_llm(model)
    quant = make_llm(model, kv_cache_dtype=kind.value)
    references = full.generate(PROMPTS, GREEDY_64)
    outputs = quant.generate(PROMPTS, GREEDY_64)
    for prompt, ref, out in zip(PROMPTS, references, outputs, strict=True):
        agreement = teacher_forced_agreement(full.engine, quant.engine, prompt, ref.token_ids)
        print(
            f"{arch} {kind.value} prompt {len(prompt)}: agreement {agreement.rate:.3f}, first "
            f"divergence {agreement.first_divergence}, max logit error "
            f"{agreement.max_logit_error:.4f}"
        )
        assert agreement.rate >= AGREEMENT_FLOOR[kind], agreement
        assert 0 < agreement.max_logit_error < LOGIT_ERROR_LIMIT[kind], agreement
        # Teacher forcing is exactly what decoding saw up to its first own divergence.
        first = first_difference(out.token_ids, ref.token_ids)
        assert first >= agreement.first_divergence


BACKENDS = ["torch", "cpu"] + (["triton"] if triton_available() else [])


@pytest.mark.parametrize("kind", QUANTIZED)
def test_torch_cpu_and_triton_paths_give_the_same_results(
    kind: KVCacheDtype,
    model_factory: Callable[..., Path],
    make_llm: Callable[..., LLM],
) -> None:
    assert os.environ["TRITON_INTERPRET"] == "1"  # tests/conftest.py: the kernels run on CPU
    model = model_factory("qwen2")  # GQA
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=20, temperature=0.9, seed=5, ignore_eos=True),
    ] * 2
    prompts = PROMPTS
    runs = {
        backend: make_llm(model, kv_cache_dtype=kind.value, attention_backend=backend)
        for backend in BACKENDS
    }
    reference = runs["torch"].generate(prompts, params)
    for backend in BACKENDS[1:]:
        outputs = runs[backend].generate(prompts, params)
        reports = compare_outputs(runs["torch"], outputs, reference, params)
        assert len(reports) <= 1, (backend, reports)


@pytest.mark.parametrize("kind", QUANTIZED)
def test_chunking_prefix_hits_speculation_and_host_tier_change_nothing(
    kind: KVCacheDtype, model_factory: Callable[..., Path], make_llm: Callable[..., LLM]
) -> None:
    """Against one int8/fp8 engine that prefills each prompt whole with no cache reuse: 16-token
    prefill chunks, a second pass served from the prefix cache (and, with a cache too small to
    keep it, from the host tier), and n-gram speculation give the same tokens and logprobs."""
    model = model_factory("llama")
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)] * 4
    plain = make_llm(model, kv_cache_dtype=kind.value, enable_prefix_caching=False)
    references = plain.generate(PROMPTS, params)
    variants = {
        "chunked": {"max_num_batched_tokens": 16},
        "speculative": {"speculative_method": "ngram", "num_speculative_tokens": 3},
        "host tier": {"num_blocks": 5, "host_cache_gib": 0.01, "max_num_seqs": 1},
    }
    for name, kwargs in variants.items():
        llm = make_llm(model, kv_cache_dtype=kind.value, **kwargs)
        for attempt in ("first pass", "second pass"):
            outputs = llm.generate(PROMPTS, params)
            reports = compare_outputs(plain, outputs, references, params)
            assert len(reports) <= 1, (name, attempt, reports)
        stats = llm.engine.stats()
        assert stats.num_prefix_hit_tokens > 0, name  # the second pass reused quantized blocks
        if name == "host tier":
            assert stats.num_host_hit_tokens > 0
        if name == "speculative":
            assert stats.num_spec_accepted_tokens > 0


@pytest.mark.parametrize("kind", QUANTIZED)
def test_the_three_decode_kernels_read_the_same_codes(kind: KVCacheDtype) -> None:
    """Kernel level: random K/V stored as codes, decode attention of a GQA batch with ragged
    context lengths through the torch path, the C++ kernel and the Triton kernel, against
    full-precision attention over the dequantized cache (the same values)."""
    from native_engine.attention import decode_gather_inputs, paged_decode_attention_torch
    from native_engine.kernels import paged_decode_attention
    from native_engine.kernels.cpu import load_cpu_kernels, paged_decode_attention_cpu
    from native_engine.kv_cache import KVCache

    gen = torch.Generator().manual_seed(1)
    layout = KVCacheLayout("fp", "float32", 8, 1, 2, 16, kind)
    cache = KVCache(layout, 12, torch.device("cpu"))
    (layer,) = cache.layers
    num_tokens = 12 * 8
    key, value = torch.randn(2, num_tokens, 2, 16, generator=gen) * 3
    slots = torch.arange(num_tokens)
    assert layer.k_scales is not None and layer.v_scales is not None
    positions = slot_positions(slots, 8)
    store_quantized(key, value, layer.k, layer.v, layer.k_scales, layer.v_scales, positions, kind)
    query = torch.randn(3, 6, 16, generator=gen)  # 3 sequences, 6 query heads over 2 kv heads
    tables = torch.tensor([[5, 1, 9, 0], [2, 3, 0, 0], [11, 10, 8, 7]], dtype=torch.int32)
    lens = torch.tensor([29, 9, 32], dtype=torch.int32)
    table, mask = decode_gather_inputs(tables, lens, 32, 8)
    want = paged_decode_attention_torch(query, layer, table, mask, 0.25)
    # The dequantized cache, as a full-precision one: the same attention, to rounding.
    full = KVCache(KVCacheLayout("fp", "float32", 8, 1, 2, 16), 12, torch.device("cpu"))
    assert layer.codebook is not None
    full.layers[0].k.copy_(dequantize(layer.k, layer.k_scales, kind, torch.float32))
    full.layers[0].v.copy_(dequantize(layer.v, layer.v_scales, kind, torch.float32))
    exact = paged_decode_attention_torch(query, full.layers[0], table, mask, 0.25)
    torch.testing.assert_close(want, exact, rtol=0, atol=1e-6)
    args = (layer.k_scales, layer.v_scales, layer.codebook)
    assert load_cpu_kernels()
    cpu = paged_decode_attention_cpu(query, layer.k, layer.v, tables, lens, 0.25, *args)
    torch.testing.assert_close(cpu, want, rtol=0, atol=1e-5)
    if triton_available():  # the interpreter on CPU; compiled (scripts/gpu_check.sh) on CUDA
        device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
        on = [t.to(device) for t in (query, layer.k, layer.v, tables, lens)]
        triton = paged_decode_attention(*on, 0.25, *(t.to(device) for t in args))
        torch.testing.assert_close(triton.cpu(), want, rtol=0, atol=1e-5)


def test_a_bad_kv_cache_dtype_is_refused_by_name(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype 'int4' is not one of auto, int8"):
        LLM(str(llama_dir), kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype must be a KVCacheDtype"):
        CacheConfig(kv_cache_dtype="int8")  # type: ignore[arg-type]
