"""Where a request's blocks lie in two KV caches, as NIXL descriptor rows for one READ (pure:
no NIXL, no torch; unit-tested with exact values).

A cache is one registered tensor ``[num_layers, 2, num_blocks, *slab]``
(``engine.kv_cache.KVCache``; a quantized slab is its codes, then its scales), so the keys
(kv 0) or values (kv 1) of one layer for one block are ``layout.slab_block_bytes`` contiguous
bytes at ``base + ((layer * 2 + kv) * num_blocks + block) * slab_block_bytes``. The sender
and the receiver have the same layout but not the same number of blocks, so each side's
addresses come from its own region. Blocks consecutive on both sides are merged into one row:
the fewer the rows, the fewer the transfer's work items.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_layout import KVCacheLayout

Row = tuple[int, int, int]  # (address, length in bytes, device id): NIXL's Nx3 descriptor row


@dataclass(frozen=True)
class Region:
    """One side's registered KV cache."""

    base_address: int
    num_blocks: int
    device_id: int = 0

    def address(self, layout: KVCacheLayout, layer: int, kv: int, block: int) -> int:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block} outside [0, {self.num_blocks})")
        index = (layer * 2 + kv) * self.num_blocks + block
        return self.base_address + index * layout.slab_block_bytes


def runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """(first source block, first destination block, count) of the maximal runs where both
    sides are consecutive, in order."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destinations")
    out: list[tuple[int, int, int]] = []
    for src, dst in zip(src_ids, dst_ids, strict=True):
        if out:
            first_src, first_dst, count = out[-1]
            if src == first_src + count and dst == first_dst + count:
                out[-1] = (first_src, first_dst, count + 1)
                continue
        out.append((src, dst, 1))
    return out


def plan_read(
    layout: KVCacheLayout,
    local: Region,
    remote: Region,
    src_ids: list[int],
    dst_ids: list[int],
) -> tuple[list[Row], list[Row]]:
    """Matching (local, remote) rows: READ ``remote`` row i into ``local`` row i. Layer-major,
    keys before values, runs in block order."""
    size = layout.slab_block_bytes
    local_rows: list[Row] = []
    remote_rows: list[Row] = []
    block_runs = runs(src_ids, dst_ids)
    for layer in range(layout.num_layers):
        for kv in (0, 1):
            for src, dst, count in block_runs:
                remote_at = remote.address(layout, layer, kv, src)
                local_at = local.address(layout, layer, kv, dst)
                remote.address(layout, layer, kv, src + count - 1)  # the run's end is inside
                local.address(layout, layer, kv, dst + count - 1)
                remote_rows.append((remote_at, count * size, remote.device_id))
                local_rows.append((local_at, count * size, local.device_id))
    return local_rows, remote_rows
