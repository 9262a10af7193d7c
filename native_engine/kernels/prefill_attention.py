"""Paged prefill attention in bf16 on AMX (``csrc/prefill_attention_amx.cpp``): a prompt row's
result is the same bits however the prompt is chunked, cached or batched.

Called by ``native_engine.attention`` once per layer for all of a step's prefill sequences on
the CPU backend (and for one alone by ``prefill_attention``), after the step's keys and values
are stored: it reads every key and value from the cache (the chunks' own included) and returns
a new tensor, the caller's. Where it does
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
    query: torch.Tensor,  # [tokens, num_q_heads, head_dim] bf16: the sequences' rows in turn
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] bf16
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, width] int64: each sequence's blocks, padded
    query_starts: torch.Tensor,  # [num_seqs + 1] int64: sequence i's rows start..start[i + 1]
    context_lens: torch.Tensor,  # [num_seqs] int64: cached tokens before a chunk + its rows
    scale: float,
) -> torch.Tensor:  # [tokens, num_q_heads, head_dim]
    out: torch.Tensor = cpu_ops().paged_prefill_attention_bf16(
        query, k_cache, v_cache, block_tables, query_starts, context_lens, scale
    )
    return out
