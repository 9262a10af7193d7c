"""Triton paged decode attention: one query token per sequence against its paged KV cache.

Work split: one program per (sequence, kv head). The program loads the whole group of query
heads that share that kv head (GQA) so each K/V block is read from memory once per group
rather than once per query head. It walks the sequence's block table one cache block at a
time and keeps an online (flash-decoding style) softmax in fp32.

A quantized cache (uint8 codes plus float32 scales per token and kv head) is decoded as it is
loaded: `codebook[code] * scale`, rounded to the query's dtype, the values the torch path and
the CPU kernel read (`native_engine.kv_quant`), so fp8 codes need no native fp8 type (the
interpreter has none).

The dot products use broadcast-multiply + `tl.sum` instead of `tl.dot`: decode tiles are far
below the 16x16 minimum of `tl.dot`, and it keeps the kernel exact under TRITON_INTERPRET.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    out_ptr: tl.tensor,
    q_ptr: tl.tensor,
    k_cache_ptr: tl.tensor,
    v_cache_ptr: tl.tensor,
    block_tables_ptr: tl.tensor,
    context_lens_ptr: tl.tensor,
    k_scales_ptr: tl.tensor,  # quantized only (else any tensor, never read)
    v_scales_ptr: tl.tensor,
    codebook_ptr: tl.tensor,
    scale: float,
    q_stride_s: int,
    q_stride_h: int,
    out_stride_s: int,
    out_stride_h: int,
    cache_stride_b: int,
    cache_stride_t: int,
    cache_stride_h: int,
    scales_stride_b: int,
    scales_stride_t: int,
    block_tables_stride_s: int,
    GROUP_SIZE: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,  # next_power_of_2(GROUP_SIZE)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next_power_of_2(HEAD_DIM)
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (power of two)
    QUANTIZED: tl.constexpr,
) -> None:
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)

    g = tl.arange(0, GROUP_PAD)  # [G]
    d = tl.arange(0, BLOCK_D)  # [D]
    t = tl.arange(0, BLOCK_SIZE)  # [T]
    g_mask = g < GROUP_SIZE
    d_mask = d < HEAD_DIM

    # Query heads of this group are contiguous: h = kv_head * GROUP_SIZE + g.
    q_head = kv_head * GROUP_SIZE + g  # [G]
    q_offs = seq * q_stride_s + q_head[:, None] * q_stride_h + d[None, :]  # [G, D]
    qd_mask = g_mask[:, None] & d_mask[None, :]
    # Padded lanes load 0 so they add nothing to the dot products and never produce NaN.
    q = tl.load(q_ptr + q_offs, mask=qd_mask, other=0.0).to(tl.float32)  # [G, D]
    q = q * scale  # fold the scale in once instead of per block

    context_len = tl.load(context_lens_ptr + seq)
    num_blocks = tl.cdiv(context_len, BLOCK_SIZE)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)  # running max, [G]
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)  # running denominator, [G]
    acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)  # running numerator, [G, D]

    for i in range(0, num_blocks):
        # int64: block_id * cache_stride_b overflows int32 for large caches.
        block_id = tl.load(block_tables_ptr + seq * block_tables_stride_s + i).to(tl.int64)
        t_mask = i * BLOCK_SIZE + t < context_len  # [T]; only the last block is partial
        kv_offs = (
            block_id * cache_stride_b
            + t[:, None] * cache_stride_t
            + kv_head * cache_stride_h
            + d[None, :]
        )  # [T, D]
        kv_mask = t_mask[:, None] & d_mask[None, :]
        if QUANTIZED:
            k_codes = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0).to(tl.int32)
            v_codes = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0).to(tl.int32)
            s_offs = block_id * scales_stride_b + t * scales_stride_t + kv_head  # [T]
            k_s = tl.load(k_scales_ptr + s_offs, mask=t_mask, other=0.0)
            v_s = tl.load(v_scales_ptr + s_offs, mask=t_mask, other=0.0)
            # Rounded to the model dtype as the torch path rounds them: the same K/V.
            k = tl.load(codebook_ptr + k_codes) * k_s[:, None]  # [T, D]
            v = tl.load(codebook_ptr + v_codes) * v_s[:, None]
            k = k.to(out_ptr.dtype.element_ty).to(tl.float32)
            v = v.to(out_ptr.dtype.element_ty).to(tl.float32)
        else:
            k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)  # [T, D]
            v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)  # [T, D]

        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, T]
        scores = tl.where(t_mask[None, :], scores, float("-inf"))

        # Every block holds >= 1 valid token, so m_new is finite and exp() never sees -inf - -inf.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # [G]
        alpha = tl.exp(m_i - m_new)  # [G]; rescales what was accumulated under the old max
        p = tl.exp(scores - m_new[:, None])  # [G, T]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)  # [G, D]
        m_i = m_new

    out = acc / l_i[:, None]  # [G, D]
    out_offs = seq * out_stride_s + q_head[:, None] * out_stride_h + d[None, :]  # [G, D]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=qd_mask)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    codebook: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q·k * scale) · v over each sequence's cached tokens; returns query's dtype.

    query: `[num_seqs, num_q_heads, head_dim]`.
    k_cache/v_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, same strides, with a
        contiguous last dim. block_size must be a power of two.
    block_tables: `[num_seqs, max_num_blocks_per_seq]` int32; entries past
        `ceil(context_lens[s] / block_size)` are ignored.
    context_lens: `[num_seqs]` int32, each >= 1 (includes the current token).
    Query head h reads kv head `h // (num_q_heads // num_kv_heads)`.
    Quantized: k_cache/v_cache are uint8 codes, k_scales/v_scales `[num_blocks, block_size,
        num_kv_heads]` float32 with a unit last stride, codebook `[256]` float32.
    """
    if query.dim() != 3:
        raise ValueError(f"query must be [num_seqs, num_q_heads, head_dim], got {query.shape}")
    num_seqs, num_q_heads, head_dim = query.shape
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must be [num_blocks, block_size, num_kv_heads, head_dim] and "
            f"equal, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"cache head_dim {cache_head_dim} != query head_dim {head_dim}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads {num_q_heads} not a multiple of {num_kv_heads}")
    if block_size & (block_size - 1) != 0:
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("k_cache/v_cache must share strides and have a contiguous last dim")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks], got {block_tables.shape}")
    if context_lens.shape != (num_seqs,):
        raise ValueError(f"context_lens must be [{num_seqs}], got {tuple(context_lens.shape)}")
    quantized = codebook is not None
    if codebook is not None:
        if k_scales is None or v_scales is None or k_cache.dtype != torch.uint8:
            raise ValueError("a quantized cache needs uint8 codes, k_scales and v_scales")
        if k_scales.shape != k_cache.shape[:3] or k_scales.stride() != v_scales.stride():
            raise ValueError(f"scales must be {tuple(k_cache.shape[:3])} with equal strides")
        if k_scales.stride(2) != 1 or codebook.shape != (256,) or not codebook.is_contiguous():
            raise ValueError("scales need a unit last stride and codebook must be [256]")
    else:
        k_scales = v_scales = codebook = context_lens  # placeholders the kernel never reads

    # The kernel indexes head_dim with unit stride.
    query = query if query.stride(2) == 1 else query.contiguous()
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    context_lens = context_lens.contiguous()
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out

    group_size = num_q_heads // num_kv_heads
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        out,
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        k_scales,
        v_scales,
        codebook,
        float(scale),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_scales.stride(0) if quantized else 0,
        k_scales.stride(1) if quantized else 0,
        block_tables.stride(0),
        GROUP_SIZE=group_size,
        GROUP_PAD=triton.next_power_of_2(group_size),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        QUANTIZED=quantized,
    )
    return out
