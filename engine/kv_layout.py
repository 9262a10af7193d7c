"""The KV cache layout two engines must share to exchange blocks (torch-free: the router and
the transfer codec's header checks use it)."""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class KVCacheLayout:
    """What a receiver must agree on before it accepts another engine's blocks."""

    model_fingerprint: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @property
    def slab_block_bytes(self) -> int:
        """Bytes of one block's keys (or values) in one layer: the unit transfers copy."""
        return self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, keys and values."""
        itemsize = DTYPE_BYTES[self.dtype]
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def mismatch(self, other: KVCacheLayout) -> str | None:
        """None when compatible, else a message naming both layouts."""
        return None if self == other else f"local layout {self} != remote layout {other}"
