"""Paged attention over the KV cache: varlen prefill with cached context, batched decode.

Tokens of one step are flattened: every prefill sequence's new tokens first, then one token per
decode sequence. K/V of the new tokens are written into the cache (by ``slot_mapping``) before
attention, so a sequence's keys are always read from the cache, never from a side buffer.

The torch path runs anywhere; on CUDA the Triton kernels in ``native_engine.kernels`` replace
the KV store and the decode attention (prefill stays on ``scaled_dot_product_attention``); on
the CPU backend the C++ kernels take decode, and bf16 prefill where the CPU has AMX.

A quantized cache (``native_engine.kv_quant``) is written by one torch store on every backend,
and every attention (prefill included) reads the keys and values back from the cache: a token
attends to the same dequantized K/V whether its context was computed in this chunk, an earlier
one, or another worker, so chunking, prefix hits and transfers never change a result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from engine.config import AttentionBackend
from native_engine.kernels import prefill_attention as amx_prefill
from native_engine.kv_cache import LayerCache
from native_engine.kv_quant import dequantize, store_quantized


@dataclass(frozen=True)
class PrefillSpan:
    """One prefill sequence's slice of the flattened batch."""

    query_start: int
    query_len: int
    context_len: int  # cached tokens before this chunk + query_len
    block_ids: torch.Tensor  # [num_blocks_of_seq] int64, on device


@dataclass(frozen=True)
class PrefillTables:
    """A step's prefill spans as the CPU prefill kernel takes them (one call a layer for all of
    them: ``kernels/prefill_attention.py``), built once per step."""

    block_tables: torch.Tensor  # [num_prefills, width] int64, zero-padded
    query_starts: torch.Tensor  # [num_prefills + 1] int64
    context_lens: torch.Tensor  # [num_prefills] int64

    @staticmethod
    def of(spans: Sequence[PrefillSpan]) -> PrefillTables:
        starts = [span.query_start for span in spans]
        starts.append(spans[-1].query_start + spans[-1].query_len)
        return PrefillTables(
            block_tables=pad_sequence([span.block_ids for span in spans], batch_first=True),
            query_starts=torch.tensor(starts, dtype=torch.long),
            context_lens=torch.tensor([span.context_len for span in spans], dtype=torch.long),
        )


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    prefills: tuple[PrefillSpan, ...]
    num_prefill_tokens: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor  # [num_decodes] int32
    backend: AttentionBackend = AttentionBackend.TORCH
    # Torch decode path, built once per step instead of once per layer:
    decode_gather_table: torch.Tensor | None = None  # [num_decodes, num_ctx_blocks] int64
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, num_ctx_blocks * block_size]
    # A quantized cache's stores, split once per step: ``kv_quant.slot_positions``.
    slot_positions: tuple[torch.Tensor, torch.Tensor] | None = None
    # The CPU backend's prefills for its kernel (spans starting at row 0, in order).
    prefill_tables: PrefillTables | None = None

    @property
    def num_decodes(self) -> int:
        return int(self.decode_context_lens.shape[0])


def store_kv_torch(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def decode_gather_inputs(
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    max_context_len: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block indices to gather and the padding mask, shared by every layer of a step."""
    num_blocks = -(-max_context_len // block_size)
    table = block_tables[:, :num_blocks].long()  # [num_seqs, num_blocks]
    positions = torch.arange(num_blocks * block_size, device=block_tables.device)
    mask = positions[None, :] < context_lens[:, None]  # [num_seqs, padded_len]
    return table, mask[:, None, None, :]


def gather_blocks(
    cache: LayerCache, block_ids: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of ``block_ids`` (any shape ``[...]``) as ``[..., block_size,
    num_kv_heads, head_dim]`` of ``dtype``, dequantized when the cache is quantized."""
    if not cache.quantized:
        return cache.k[block_ids], cache.v[block_ids]
    assert cache.k_scales is not None and cache.v_scales is not None
    return (
        dequantize(cache.k[block_ids], cache.k_scales[block_ids], cache.kind, dtype),
        dequantize(cache.v[block_ids], cache.v_scales[block_ids], cache.kind, dtype),
    )


def paged_decode_attention_torch(
    query: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]
    cache: LayerCache,
    table: torch.Tensor,  # [num_seqs, num_ctx_blocks] int64
    mask: torch.Tensor,  # [num_seqs, 1, 1, num_ctx_blocks * block_size] bool
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    num_seqs, num_q_heads, head_dim = query.shape
    num_kv_heads = cache.k.shape[2]
    padded_len = mask.shape[-1]
    # Gathering whole blocks copies contiguous runs of block_size * heads * head_dim elements.
    k_blocks, v_blocks = gather_blocks(cache, table, query.dtype)
    keys = k_blocks.view(num_seqs, padded_len, num_kv_heads, head_dim)
    values = v_blocks.view(num_seqs, padded_len, num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2),  # [num_seqs, num_q_heads, 1, head_dim]
        keys.transpose(1, 2),  # [num_seqs, num_kv_heads, padded_len, head_dim]
        values.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
        enable_gqa=num_q_heads != num_kv_heads,
    )
    return out.squeeze(2)


def _amx_prefill(
    query: torch.Tensor,  # [tokens, q_heads, D]: the tables' sequences, back to back
    cache: LayerCache,
    tables: PrefillTables,
    scale: float,
) -> torch.Tensor:
    """The AMX prefill kernel over a step's (or one span's) tables."""
    out: torch.Tensor = amx_prefill.paged_prefill_attention(
        query,
        cache.k,
        cache.v,
        tables.block_tables,
        tables.query_starts,
        tables.context_lens,
        scale,
    )
    return out


def prefill_attention(
    query: torch.Tensor,  # [query_len, num_q_heads, head_dim]
    key: torch.Tensor,  # [query_len, num_kv_heads, head_dim] (this chunk's keys)
    value: torch.Tensor,
    cache: LayerCache,
    span: PrefillSpan,
    scale: float,
    backend: AttentionBackend = AttentionBackend.TORCH,
) -> torch.Tensor:  # [query_len, num_q_heads, head_dim]
    if (
        backend is AttentionBackend.CPU
        and not cache.quantized
        and amx_prefill.applies(query, cache.k)
    ):
        # Chunk-invariant (kernels/prefill_attention.py); SDPA's rows move with the chunking.
        # A batch of one: the span's rows are all of `query`.
        return _amx_prefill(query, cache, PrefillTables.of([replace(span, query_start=0)]), scale)
    # 4-D inputs: torch's fused CPU attention kernel does not take 3-D ones (math fallback).
    num_q_heads, num_kv_heads = query.shape[1], key.shape[1]
    q = query.transpose(0, 1)[None]  # [1, num_q_heads, query_len, head_dim]
    if span.context_len == span.query_len and not cache.quantized:
        # No cached context: the chunk's own K/V are the whole sequence.
        k, v = key.transpose(0, 1)[None], value.transpose(0, 1)[None]
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=num_q_heads != num_kv_heads
        )[0].transpose(0, 1)
    head_dim = key.shape[2]
    k_blocks, v_blocks = gather_blocks(cache, span.block_ids, query.dtype)
    k = k_blocks.view(-1, num_kv_heads, head_dim)[: span.context_len]
    v = v_blocks.view(-1, num_kv_heads, head_dim)[: span.context_len]
    # Query i sits at absolute position (context_len - query_len + i) and sees keys up to it.
    offset = span.context_len - span.query_len
    rows = torch.arange(span.query_len, device=query.device)[:, None] + offset
    mask = torch.arange(span.context_len, device=query.device)[None, :] <= rows
    return F.scaled_dot_product_attention(
        q,
        k.transpose(0, 1)[None],  # [1, num_kv_heads, context_len, head_dim]
        v.transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=num_q_heads != num_kv_heads,
    )[0].transpose(0, 1)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    cache: LayerCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    if cache.quantized:
        assert cache.k_scales is not None and cache.v_scales is not None
        assert meta.slot_positions is not None  # the runner splits the slots of a quantized cache
        store_quantized(
            key,
            value,
            cache.k,
            cache.v,
            cache.k_scales,
            cache.v_scales,
            meta.slot_positions,
            cache.kind,
        )
    elif meta.backend is AttentionBackend.TRITON:
        from native_engine.kernels import store_kv

        store_kv(key, value, cache.k, cache.v, meta.slot_mapping)
    else:
        store_kv_torch(key, value, cache.k, cache.v, meta.slot_mapping)
    outputs: list[torch.Tensor] = []
    tables = meta.prefill_tables
    if (
        tables is not None
        and meta.backend is AttentionBackend.CPU
        and not cache.quantized
        and amx_prefill.applies(query, cache.k)
    ):
        # Every prefill sequence in one call (each row's bits as in a call of its own).
        outputs.append(_amx_prefill(query[: meta.num_prefill_tokens], cache, tables, scale))
    else:
        for span in meta.prefills:
            end = span.query_start + span.query_len
            outputs.append(
                prefill_attention(
                    query[span.query_start : end],
                    key[span.query_start : end],
                    value[span.query_start : end],
                    cache,
                    span,
                    scale,
                    meta.backend,
                )
            )
    if meta.num_decodes:
        outputs.append(_decode_attention(query[meta.num_prefill_tokens :], cache, meta, scale))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)


def _decode_attention(
    query: torch.Tensor,  # [num_decodes, num_q_heads, head_dim]
    cache: LayerCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    if meta.backend is not AttentionBackend.TORCH:
        # The two kernels take the same arguments (codes with scales when quantized).
        if meta.backend is AttentionBackend.TRITON:
            from native_engine.kernels import paged_decode_attention as kernel
        else:
            from native_engine.kernels.cpu import paged_decode_attention_cpu as kernel
        return kernel(
            query,
            cache.k,
            cache.v,
            meta.decode_block_tables,
            meta.decode_context_lens,
            scale,
            cache.k_scales,
            cache.v_scales,
            cache.codebook,
        )
    assert meta.decode_gather_table is not None and meta.decode_mask is not None
    return paged_decode_attention_torch(
        query, cache, meta.decode_gather_table, meta.decode_mask, scale
    )
