"""Where a request's blocks lie in two KV caches, as NIXL descriptor rows for one READ (pure:
no NIXL, no torch; unit-tested with exact values).

Each side's pages say where their slabs lie (``engine.kv_pages.SlabSpans``): slab ``s``
(``layer * 2 + kv``) of block ``b`` is ``layout.slab_block_bytes`` contiguous bytes at
``bases[s] + b * strides[s]``. The native engine's one tensor ``[num_layers, 2, num_blocks,
*slab]`` has ``strides[s] = slab_block_bytes``; vLLM's block-major pages have a page's bytes as
the stride (a head range of them too: a tensor-parallel shard). The sender and the receiver
have the same slab layout but not the same number of blocks nor the same arrangement, so each
side's addresses come from its own region. Rows adjacent on both sides are merged: the fewer
the rows, the fewer the transfer's work items (consecutive blocks of the native cache, the two
halves of a vLLM page and consecutive pages).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_layout import KVCacheLayout

Row = tuple[int, int, int]  # (address, length in bytes, device id): NIXL's Nx3 descriptor row


@dataclass(frozen=True)
class Region:
    """One side's registered KV pages: per slab, where block 0's lies and the block stride."""

    bases: tuple[int, ...]
    strides: tuple[int, ...]
    num_blocks: int
    device_id: int = 0

    @classmethod
    def contiguous(
        cls, base_address: int, layout: KVCacheLayout, num_blocks: int, device_id: int = 0
    ) -> Region:
        """A ``[num_layers, 2, num_blocks, *slab]`` tensor at ``base_address``."""
        size, count = layout.slab_block_bytes, 2 * layout.num_layers
        bases = tuple(base_address + s * num_blocks * size for s in range(count))
        return cls(bases, (size,) * count, num_blocks, device_id)

    def address(self, layout: KVCacheLayout, layer: int, kv: int, block: int) -> int:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block} outside [0, {self.num_blocks})")
        slab = layer * 2 + kv
        if len(self.bases) != 2 * layout.num_layers or len(self.strides) != len(self.bases):
            raise ValueError(
                f"{len(self.bases)} slab bases, {len(self.strides)} strides for "
                f"{layout.num_layers} layers"
            )
        return self.bases[slab] + block * self.strides[slab]


def plan_read(
    layout: KVCacheLayout,
    local: Region,
    remote: Region,
    src_ids: list[int],
    dst_ids: list[int],
) -> tuple[list[Row], list[Row]]:
    """Matching (local, remote) rows: READ ``remote`` row i into ``local`` row i; in local
    address order, rows adjacent on both sides merged."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destinations")
    size = layout.slab_block_bytes
    pieces = sorted(
        (local.address(layout, layer, kv, dst), remote.address(layout, layer, kv, src))
        for layer in range(layout.num_layers)
        for kv in (0, 1)
        for src, dst in zip(src_ids, dst_ids, strict=True)
    )
    merged: list[list[int]] = []  # [local address, remote address, length]
    for local_at, remote_at in pieces:
        if merged:
            last = merged[-1]
            if local_at == last[0] + last[2] and remote_at == last[1] + last[2]:
                last[2] += size
                continue
        merged.append([local_at, remote_at, size])
    local_rows = [(at, length, local.device_id) for at, _, length in merged]
    remote_rows = [(at, length, remote.device_id) for _, at, length in merged]
    return local_rows, remote_rows
