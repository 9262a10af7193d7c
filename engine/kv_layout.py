"""The KV cache layout two engines must share to exchange blocks (torch-free: the router and
the transfer codec's header checks use it).

A block's keys (or values) in one layer are one *slab*: ``slab_block_bytes`` contiguous bytes,
the unit every transfer backend copies. Full-precision slabs hold
``[block_size, num_kv_heads, head_dim]`` elements of ``dtype``. Quantized slabs
(``kv_cache_dtype`` int8 / fp8_e4m3) hold the one-byte codes ``[block_size, num_kv_heads,
head_dim]`` followed by their float32 scales ``[block_size, num_kv_heads]`` (one per token and
kv head), so a backend that moves slabs moves the scales with the codes and needs no second
buffer. See docs/engine.md "Quantized KV cache" for why the scales are per token and head.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from engine.dtypes import ModelDtype

# What a slab's bytes mean in the native engine's cache (``native_engine.kv_cache``); another engine
# names its own arrangement (the vLLM engine: "vllm-<version>/<attention backend>/<layout>").
NATIVE_PAGE_LAYOUT = "pdserve"
SCALE_BYTES = 4  # float32


class KVCacheDtype(enum.Enum):
    """How keys and values are stored: the model's dtype, or one byte per element plus scales."""

    AUTO = "auto"  # the model's dtype
    INT8 = "int8"  # symmetric int8, absmax / 127 per token and kv head
    FP8_E4M3 = "fp8_e4m3"  # float8 e4m3fn codes, absmax / 448 per token and kv head

    @property
    def quantized(self) -> bool:
        return self is not KVCacheDtype.AUTO

    @classmethod
    def parse(cls, name: str) -> KVCacheDtype:
        """From a flag, a kwarg or a peer's layout; an unknown name is refused by name."""
        try:
            return cls(name)
        except ValueError:
            raise ValueError(
                f"kv_cache_dtype {name!r} is not one of {', '.join(KV_CACHE_DTYPE_NAMES)}"
            ) from None


KV_CACHE_DTYPE_NAMES = tuple(d.value for d in KVCacheDtype)


@dataclass(frozen=True)
class KVCacheLayout:
    """What a receiver must agree on before it accepts another engine's blocks."""

    model_fingerprint: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO
    page_layout: str = NATIVE_PAGE_LAYOUT
    # Tensor parallelism: the pages are shard ``tp_rank`` of ``tp_size`` (``num_kv_heads`` is
    # the shard's heads). An engine's own layout is its rank 0's; which shards move between
    # engines of different ``tp_size`` is ``engine/kv_shards.py``'s rule.
    tp_size: int = 1
    tp_rank: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is not in [0, tp_size {self.tp_size})")
        if self.quantized and self.num_codes_per_slab % SCALE_BYTES:
            # The scales follow the codes as float32: they must start 4-byte aligned.
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype.value} needs block_size * num_kv_heads * "
                f"head_dim divisible by {SCALE_BYTES}, got {self.num_codes_per_slab}"
            )

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype.quantized

    @property
    def num_codes_per_slab(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_dim

    @property
    def storage_dtype(self) -> str:
        """The element type of the cache tensor (bytes when quantized)."""
        return "uint8" if self.quantized else self.dtype

    @property
    def slab_shape(self) -> tuple[int, ...]:
        """The cache tensor's trailing dims: one slab."""
        if self.quantized:
            return (self.slab_block_bytes,)
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def slab_block_bytes(self) -> int:
        """Bytes of one block's keys (or values) in one layer, scales included."""
        if self.quantized:
            return self.num_codes_per_slab + self.block_size * self.num_kv_heads * SCALE_BYTES
        return self.num_codes_per_slab * ModelDtype(self.dtype).itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, keys and values."""
        return 2 * self.num_layers * self.slab_block_bytes

    def shard(self, tp_rank: int) -> KVCacheLayout:
        """The layout of this engine's rank ``tp_rank`` (same heads per rank)."""
        return dataclasses.replace(self, tp_rank=tp_rank)

    def mismatch(self, other: KVCacheLayout) -> str | None:
        """None when compatible, else a message naming the fields that differ and both
        layouts."""
        if self == other:
            return None
        differ = [
            f"{f.name} {_show(getattr(self, f.name))} != {_show(getattr(other, f.name))}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        return f"{'; '.join(differ)} (local layout {self} != remote layout {other})"


def _show(value: object) -> str:
    return value.value if isinstance(value, enum.Enum) else str(value)
