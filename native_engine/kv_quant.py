"""KV quantization: one-byte codes with a float32 scale per token and kv head.

Every path (the torch path, the native CPU kernel, the Triton kernels) stores with ``quantize``
below and reads a key or value back as

    value = round_to_model_dtype(float32(code) * scale)   # scale = absmax(token, kv head) / QMAX

so the three read exactly the same keys and values. The kernels decode a code through a
256-entry *codebook* (the float32 value of each byte: int8 codes are two's-complement bytes,
fp8_e4m3 codes float8 e4m3fn bit patterns), so no kernel needs a native fp8 type (the Triton
interpreter has none); the torch path reinterprets the bytes, which gives the same values
without a gather. The codebook entries 0x7f / 0xff of e4m3fn are NaN and never stored: the
quantized values are clamped to +-448 first.
"""

from __future__ import annotations

import functools

import torch

from engine.kv_layout import KVCacheDtype

QMAX = {KVCacheDtype.INT8: 127.0, KVCacheDtype.FP8_E4M3: 448.0}


@functools.cache
def _codebook_cpu(kind: KVCacheDtype) -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if kind is KVCacheDtype.INT8:
        return codes.view(torch.int8).float()
    if kind is KVCacheDtype.FP8_E4M3:
        return codes.view(torch.float8_e4m3fn).float()
    raise ValueError(f"kv_cache_dtype {kind.value} has no codebook")


def codebook(kind: KVCacheDtype, device: torch.device) -> torch.Tensor:
    """``[256]`` float32: the value each byte code stands for."""
    return _codebook_cpu(kind).to(device)


def quantize(
    x: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], any float dtype
    kind: KVCacheDtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[num_tokens, heads, head_dim]`` uint8 and scales ``[num_tokens, heads]`` f32."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)  # [num_tokens, heads]
    qmax = QMAX[kind]
    # An all-zero row keeps scale 1 (its codes are all 0): never a division by zero.
    scales = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    y = (xf / scales[..., None]).clamp(-qmax, qmax)
    if kind is KVCacheDtype.INT8:
        codes = y.round().to(torch.int8).view(torch.uint8)
    else:
        codes = y.to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, scales


def dequantize(
    codes: torch.Tensor,  # [..., head_dim] uint8
    scales: torch.Tensor,  # [...] float32
    kind: KVCacheDtype,
    dtype: torch.dtype,
) -> torch.Tensor:  # [..., head_dim] of dtype
    """``codebook(kind)[codes] * scales``, by reinterpreting the bytes (no int64 gather index)."""
    assert kind.quantized, kind
    values = codes.view(torch.int8 if kind is KVCacheDtype.INT8 else torch.float8_e4m3fn)
    return (values.float() * scales[..., None]).to(dtype)


def slot_positions(
    slot_mapping: torch.Tensor,  # [num_tokens] int64: block_id * block_size + offset
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block_ids, offsets)`` ``[num_tokens]`` each: where ``store_quantized`` writes. A
    quantized cache's code and scale views are strided by slab (not one flat slot array), so
    the slots are split once per step (``AttentionMetadata.slot_positions``), not per layer."""
    return slot_mapping // block_size, slot_mapping % block_size


def store_quantized(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_codes: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] uint8 (a view)
    v_codes: torch.Tensor,
    k_scales: torch.Tensor,  # [num_blocks, block_size, num_kv_heads] float32 (a view)
    v_scales: torch.Tensor,
    positions: tuple[torch.Tensor, torch.Tensor],  # slot_positions(slot_mapping, block_size)
    kind: KVCacheDtype,
) -> None:
    """Quantize each new token on its own and write codes and scales at its slot. A token's
    bytes depend only on its own K/V, never on which other tokens shared the write, so chunked
    prefill, speculative verification and a migrated replay store the same bytes."""
    blocks, offsets = positions
    for data, codes_view, scales_view in ((key, k_codes, k_scales), (value, v_codes, v_scales)):
        codes, scales = quantize(data, kind)
        codes_view[blocks, offsets] = codes
        scales_view[blocks, offsets] = scales
