"""Triton kernels for the paged-KV engine.

`store_kv` scatters new K/V into the paged cache; `paged_decode_attention` runs single-token
decode attention over it. Triton is imported lazily so that importing this package (and the
rest of the engine) works on machines without triton; calling a kernel there raises
RuntimeError. On CPU-only hosts the kernels run under the Triton interpreter when
TRITON_INTERPRET=1 is set before the first call.
"""

import importlib.util

import torch

__all__ = ["paged_decode_attention", "store_kv", "triton_available"]


def triton_available() -> bool:
    """True when triton is importable, i.e. the kernels below can be called."""
    return importlib.util.find_spec("triton") is not None


def _require_triton() -> None:
    if not triton_available():
        raise RuntimeError(
            "native_engine.kernels needs the 'triton' package (pip install triton); "
            "it is not installed in this environment"
        )


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value `[num_tokens, num_kv_heads, head_dim]` into the paged caches
    `[num_blocks, block_size, num_kv_heads, head_dim]` at flat slots `slot_mapping`
    (`block_id * block_size + offset`); slot -1 skips the token. See `kv_store.store_kv`."""
    _require_triton()
    from native_engine.kernels.kv_store import store_kv as impl

    impl(key, value, k_cache, v_cache, slot_mapping)


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
    """Decode attention of query `[num_seqs, num_q_heads, head_dim]` over each sequence's
    first `context_lens[s]` cached tokens, found via `block_tables`; GQA-aware. Returns
    `[num_seqs, num_q_heads, head_dim]` in query's dtype. A quantized cache passes uint8 codes
    with their scales and codebook (see `native_engine.kv_quant`). See
    `decode_attention.paged_decode_attention`."""
    _require_triton()
    from native_engine.kernels.decode_attention import paged_decode_attention as impl

    return impl(
        query, k_cache, v_cache, block_tables, context_lens, scale, k_scales, v_scales, codebook
    )
