"""A bf16 or fp32 decode step's layer as one C++ call (``DecoderLayer.fused_decode``) against
the same layer run op by op in Python: the same output and residual bits, the same keys and
values written to the same slots, for batch sizes across the GEMM kernel's range, with and
without a qkv bias (Qwen2). And a step outside what it runs keeps the Python path."""

from __future__ import annotations

import pytest
import torch

from engine.config import AttentionBackend
from engine.model_config import ModelConfig, RopeConfig
from native_engine.attention import AttentionMetadata
from native_engine.kernels import small_gemm
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
def test_the_fused_layer_is_the_python_layer_bit_for_bit(
    qkv_bias: bool, dtype: torch.dtype
) -> None:
    isa = small_gemm.chosen(dtype)
    assert isa is not None
    config = smollm_layer_config(qkv_bias)
    layer = random_layer(config, seed=1, dtype=dtype)
    rows_served = layer.fused_rows()
    assert rows_served == small_gemm.max_rows(isa, dtype)
    rope_table = RotaryEmbedding(config.rope, 64, 2048, dtype)
    gen = torch.Generator().manual_seed(2)
    shape = (BLOCKS, BLOCK, 3, 64)
    k0 = torch.randn(shape, generator=gen).to(dtype)
    v0 = torch.randn(shape, generator=gen).to(dtype)
    # The largest batch the kernel serves, or (AMX: every M) one past its switch to panels.
    for rows in sorted({1, 3, min(rows_served, 50)}):
        meta, positions = decode_step(rows, seed=rows)
        rope = rope_table.lookup(positions)
        x = torch.randn(rows, 576, generator=gen).to(dtype)
        residual = torch.randn(rows, 576, generator=gen).to(dtype)
        for before in (None, residual):  # layer 0, and any other
            python_cache = LayerCache(k0.clone(), v0.clone())
            fused_cache = LayerCache(k0.clone(), v0.clone())
            want = layer(x, before, rope, python_cache, meta)
            got = layer.fused_decode(x, before, rope, fused_cache, meta)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), rows
            assert torch.equal(fused_cache.k, python_cache.k)
            assert torch.equal(fused_cache.v, python_cache.v)


def test_a_layer_with_qk_norm_or_a_gemm_off_the_kernel_is_not_fused() -> None:
    config = smollm_layer_config(qkv_bias=False)
    qwen3 = ModelConfig(**{**config.__dict__, "qk_norm": True})
    assert random_layer(qwen3, seed=3).fused_rows() == 0
    assert random_layer(config, seed=3, dtype=torch.float16).fused_rows() == 0  # no fp16 kernel
