"""Triton kernel that scatters freshly computed K/V into the paged KV cache.

The cache is `[num_blocks, block_size, num_kv_heads, head_dim]`; viewed as a flat array of
slots, token `i` goes to slot `slot_mapping[i] = block_id * block_size + offset_in_block`.
A slot of -1 marks a token whose K/V must not be written (e.g. padding).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr: tl.tensor,
    value_ptr: tl.tensor,
    k_cache_ptr: tl.tensor,
    v_cache_ptr: tl.tensor,
    slot_mapping_ptr: tl.tensor,
    key_stride_t: int,
    key_stride_h: int,
    key_stride_d: int,
    value_stride_t: int,
    value_stride_h: int,
    value_stride_d: int,
    HEAD_DIM: tl.constexpr,
    ROW_SIZE: tl.constexpr,  # num_kv_heads * head_dim: one cache slot, contiguous
    BLOCK_ROW: tl.constexpr,  # next_power_of_2(ROW_SIZE): tl.arange needs a power of two
) -> None:
    # One program per token: a whole slot (all kv heads) is small, so a single masked
    # vector copy is enough and keeps the kernel trivial.
    token = tl.program_id(0)
    # int64 so slot * ROW_SIZE cannot overflow for large caches.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)

    offs = tl.arange(0, BLOCK_ROW)  # [BLOCK_ROW]
    # Skipped tokens (slot -1) mask out every lane instead of branching. The limit is folded
    # into one comparison because `vector & scalar_bool` breaks the Triton interpreter.
    mask = offs < tl.where(slot >= 0, ROW_SIZE, 0)
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM

    # key/value may be strided views (e.g. slices of a fused QKV projection).
    k = tl.load(
        key_ptr + token * key_stride_t + head * key_stride_h + dim * key_stride_d, mask=mask
    )
    v = tl.load(
        value_ptr + token * value_stride_t + head * value_stride_h + dim * value_stride_d,
        mask=mask,
    )
    dst = slot * ROW_SIZE + offs  # [BLOCK_ROW]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write `key[i]`/`value[i]` into cache slot `slot_mapping[i]` in place; -1 skips.

    key/value: `[num_tokens, num_kv_heads, head_dim]` (any strides).
    k_cache/v_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, contiguous.
    slot_mapping: `[num_tokens]` integer tensor.
    """
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"key/value must be [num_tokens, num_kv_heads, head_dim] and equal, "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    num_tokens, num_kv_heads, head_dim = key.shape
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must be [num_blocks, block_size, num_kv_heads, head_dim] and "
            f"equal, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"cache head shape {tuple(k_cache.shape[2:])} != key head shape "
            f"{(num_kv_heads, head_dim)}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return

    row_size = num_kv_heads * head_dim
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        key.stride(2),
        value.stride(0),
        value.stride(1),
        value.stride(2),
        HEAD_DIM=head_dim,
        ROW_SIZE=row_size,
        BLOCK_ROW=triton.next_power_of_2(row_size),
    )
