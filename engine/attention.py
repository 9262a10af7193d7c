"""Paged attention over the KV cache: varlen prefill with cached context, batched decode.

Tokens of one step are flattened: every prefill sequence's new tokens first, then one token per
decode sequence. K/V of the new tokens are written into the cache (by ``slot_mapping``) before
attention, so a sequence's keys are always read from the cache, never from a side buffer.

The torch path runs anywhere; on CUDA the Triton kernels in ``engine.kernels`` replace the KV store
and the decode attention (prefill stays on ``scaled_dot_product_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillSpan:
    """One prefill sequence's slice of the flattened batch."""

    query_start: int
    query_len: int
    context_len: int  # cached tokens before this chunk + query_len
    block_ids: torch.Tensor  # [num_blocks_of_seq] int64, on device


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    prefills: tuple[PrefillSpan, ...]
    num_prefill_tokens: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor  # [num_decodes] int32
    decode_max_context_len: int
    use_triton: bool = False

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


def paged_decode_attention_torch(
    query: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    max_context_len: int,
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    num_seqs, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_blocks = -(-max_context_len // block_size)
    table = block_tables[:, :num_blocks].long()
    # Gathering whole blocks copies contiguous runs of block_size * heads * head_dim elements.
    keys = k_cache[table].view(num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
    values = v_cache[table].view(num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
    positions = torch.arange(num_blocks * block_size, device=query.device)
    mask = positions[None, :] < context_lens[:, None]  # [num_seqs, padded_len]
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2),  # [num_seqs, num_q_heads, 1, head_dim]
        keys.transpose(1, 2),  # [num_seqs, num_kv_heads, padded_len, head_dim]
        values.transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=num_q_heads != num_kv_heads,
    )
    return out.squeeze(2)


def prefill_attention(
    query: torch.Tensor,  # [query_len, num_q_heads, head_dim]
    key: torch.Tensor,  # [query_len, num_kv_heads, head_dim] (this chunk's keys)
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    span: PrefillSpan,
    scale: float,
) -> torch.Tensor:  # [query_len, num_q_heads, head_dim]
    num_q_heads, num_kv_heads = query.shape[1], key.shape[1]
    q = query.transpose(0, 1)  # [num_q_heads, query_len, head_dim]
    if span.context_len == span.query_len:
        # No cached context: the chunk's own K/V are the whole sequence.
        k, v = key.transpose(0, 1), value.transpose(0, 1)
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=num_q_heads != num_kv_heads
        ).transpose(0, 1)
    head_dim = key.shape[2]
    k = k_cache[span.block_ids].view(-1, num_kv_heads, head_dim)[: span.context_len]
    v = v_cache[span.block_ids].view(-1, num_kv_heads, head_dim)[: span.context_len]
    # Query i sits at absolute position (context_len - query_len + i) and sees keys up to it.
    offset = span.context_len - span.query_len
    rows = torch.arange(span.query_len, device=query.device)[:, None] + offset
    mask = torch.arange(span.context_len, device=query.device)[None, :] <= rows
    return F.scaled_dot_product_attention(
        q,
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=num_q_heads != num_kv_heads,
    ).transpose(0, 1)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    if meta.use_triton:
        from engine.kernels import store_kv

        store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    else:
        store_kv_torch(key, value, k_cache, v_cache, meta.slot_mapping)
    outputs: list[torch.Tensor] = []
    for span in meta.prefills:
        end = span.query_start + span.query_len
        outputs.append(
            prefill_attention(
                query[span.query_start : end],
                key[span.query_start : end],
                value[span.query_start : end],
                k_cache,
                v_cache,
                span,
                scale,
            )
        )
    if meta.num_decodes:
        decode_query = query[meta.num_prefill_tokens :]
        if meta.use_triton:
            from engine.kernels import paged_decode_attention

            outputs.append(
                paged_decode_attention(
                    decode_query,
                    k_cache,
                    v_cache,
                    meta.decode_block_tables,
                    meta.decode_context_lens,
                    scale,
                )
            )
        else:
            outputs.append(
                paged_decode_attention_torch(
                    decode_query,
                    k_cache,
                    v_cache,
                    meta.decode_block_tables,
                    meta.decode_context_lens,
                    meta.decode_max_context_len,
                    scale,
                )
            )
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
