"""A bf16 or fp32 decode step's decoder layers as one C++ call (``fused_ops.decode_layers``)
against the same layers run op by op in Python: the same output and residual bits, the same
keys and values written to the same slots, for batch sizes across the GEMM kernel's range, with
and without a qkv bias (Qwen2). And a step outside what it runs keeps the Python path."""

from __future__ import annotations

import pytest
import torch

from engine.config import AttentionBackend
from engine.model_config import ModelConfig, RopeConfig
from native_engine.attention import AttentionMetadata
from native_engine.kernels import fused_ops, small_gemm
from native_engine.kv_cache import LayerCache
from native_engine.models.layers import RotaryEmbedding
from native_engine.models.llama import DecoderLayer

BLOCK, BLOCKS = 32, 512


def smollm_layer_config(qkv_bias: bool) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=1024,
        hidden_size=576,
        num_layers=1,
        num_q_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate_size=1536,
        rms_norm_eps=1e-5,
        max_position_embeddings=2048,
        rope=RopeConfig(theta=100000.0),
        qkv_bias=qkv_bias,
        qk_norm=False,
        tie_word_embeddings=True,
        checkpoint_dtype="bfloat16",
        bos_token_id=None,
        eos_token_ids=(2,),
        sliding_window=None,
    )


def random_layer(
    config: ModelConfig, seed: int, dtype: torch.dtype = torch.bfloat16
) -> DecoderLayer:
    gen = torch.Generator().manual_seed(seed)
    layer = DecoderLayer(config, dtype)
    for param in layer.parameters():
        param.data = (torch.randn(param.shape, generator=gen) * 0.05).to(dtype)
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        norm.weight.data = (1 + torch.randn(norm.weight.shape, generator=gen) * 0.1).to(dtype)
    for module in layer.modules():
        if hasattr(module, "prepack"):
            module.prepack()
    return layer


def decode_step(rows: int, seed: int) -> tuple[AttentionMetadata, torch.Tensor]:
    """Rows of sequences with contexts of 1 to ~300 tokens over scattered blocks; each row's new
    token goes to the slot after its context."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 300, (rows,), generator=gen, dtype=torch.int32)
    blocks = torch.randperm(BLOCKS, generator=gen)[: rows * 10].view(rows, 10).int()
    ends = [int(n) - 1 for n in lens]
    slots = torch.tensor(
        [int(blocks[r, e // BLOCK]) * BLOCK + e % BLOCK for r, e in enumerate(ends)],
        dtype=torch.int64,
    )
    meta = AttentionMetadata(
        slot_mapping=slots,
        prefills=(),
        num_prefill_tokens=0,
        decode_block_tables=blocks,
        decode_context_lens=lens,
        backend=AttentionBackend.CPU,
    )
    return meta, lens - 1  # positions


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("qkv_bias", [False, True], ids=["llama", "qwen2-bias"])
def test_the_fused_layers_are_the_python_layers_bit_for_bit(
    qkv_bias: bool, dtype: torch.dtype
) -> None:
    isa = small_gemm.chosen(dtype)
    assert isa is not None
    config = smollm_layer_config(qkv_bias)
    layers = [random_layer(config, seed=seed, dtype=dtype) for seed in (1, 2, 3)]
    weights = [layer.fused_weights() for layer in layers]
    assert all(w is not None and w.max_rows == small_gemm.max_rows(isa, dtype) for w in weights)
    stack = fused_ops.FusedStack.of([w for w in weights if w is not None])
    assert stack is not None
    rope_table = RotaryEmbedding(config.rope, 64, 2048, dtype)
    gen = torch.Generator().manual_seed(2)
    shape = (BLOCKS, BLOCK, 3, 64)
    k0 = [torch.randn(shape, generator=gen).to(dtype) for _ in layers]
    v0 = [torch.randn(shape, generator=gen).to(dtype) for _ in layers]
    # The largest batch the kernel serves, or (AMX: every M) one past its switch to panels.
    for rows in sorted({1, 3, min(stack.max_rows, 50)}):
        meta, positions = decode_step(rows, seed=rows)
        rope = rope_table.lookup(positions)
        x = torch.randn(rows, 576, generator=gen).to(dtype)
        residual = torch.randn(rows, 576, generator=gen).to(dtype)
        for before in (None, residual):  # from layer 0, and from any other
            python = [LayerCache(k.clone(), v.clone()) for k, v in zip(k0, v0, strict=True)]
            fused = [LayerCache(k.clone(), v.clone()) for k, v in zip(k0, v0, strict=True)]
            want: tuple[torch.Tensor, torch.Tensor | None] = (x, before)
            for layer, cache in zip(layers, python, strict=True):
                want = layer(*want, rope, cache, meta)
            got = fused_ops.decode_layers(
                x, before, rope, [c.k for c in fused], [c.v for c in fused], meta, stack
            )
            assert want[1] is not None
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), rows
            for a, b in zip(fused, python, strict=True):
                assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def test_a_layer_with_qk_norm_or_a_gemm_off_the_kernel_is_not_fused() -> None:
    config = smollm_layer_config(qkv_bias=False)
    qwen3 = ModelConfig(**{**config.__dict__, "qk_norm": True})
    assert random_layer(qwen3, seed=3).fused_weights() is None
    # no fp16 kernel
    assert random_layer(config, seed=3, dtype=torch.float16).fused_weights() is None


def test_layers_that_differ_in_a_shared_constant_do_not_stack() -> None:
    plain = random_layer(smollm_layer_config(qkv_bias=False), seed=4).fused_weights()
    biased = random_layer(smollm_layer_config(qkv_bias=True), seed=5).fused_weights()
    assert plain is not None and biased is not None
    assert fused_ops.FusedStack.of([]) is None
    assert fused_ops.FusedStack.of([plain, biased]) is None
    stack = fused_ops.FusedStack.of([biased, biased])
    assert stack is not None and len(stack.qkv_biases) == 2
    no_bias = fused_ops.FusedStack.of([plain])
    assert no_bias is not None and no_bias.qkv_biases == ()
