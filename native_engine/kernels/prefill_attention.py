"""Paged prefill attention in bf16 on AMX (``csrc/prefill_attention_amx.cpp``): a prompt row's
result is the same bits however the prompt is chunked, cached or batched.

Called by ``native_engine.attention.prefill_attention`` for each prefill sequence of a step on
the CPU backend, after the step's keys and values are stored: it reads every key and value
from the cache (the chunk's own included) and returns a new tensor, the caller's. Where it does
not apply (another dtype, a quantized cache, no AMX) the caller keeps torch's SDPA.
"""

from __future__ import annotations

import functools

import torch

from native_engine.kernels import small_gemm
from native_engine.kernels.cpu import cpu_ops


@functools.cache
def available() -> bool:
    """Whether this build has the kernel and this CPU lets the process use AMX tiles (the GEMM's
    check asks for them)."""
    return small_gemm.GemmIsa.AMX in small_gemm.available(torch.bfloat16) and bool(
        cpu_ops().prefill_attention_amx_built()
    )


def applies(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (
        query.dtype == torch.bfloat16
        and k_cache.dtype == torch.bfloat16
        and k_cache.is_contiguous()
        and query.device.type == "cpu"
        and query.shape[-1] % 32 == 0
        and query.stride(-1) == 1
        and query.stride(-2) == query.shape[-1]
        and available()
    )


def paged_prefill_attention(
    query: torch.Tensor,  # [query_len, num_q_heads, head_dim] bf16, each token's heads whole
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] bf16
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,  # [num_blocks_of_seq] int64
    context_len: int,  # cached tokens before the chunk + query_len
    scale: float,
) -> torch.Tensor:  # [query_len, num_q_heads, head_dim]
    out: torch.Tensor = cpu_ops().paged_prefill_attention_bf16(
        query, k_cache, v_cache, block_ids.contiguous(), context_len, scale
    )
    return out
