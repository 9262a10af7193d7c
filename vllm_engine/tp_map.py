"""Which prefill rank each decode rank pulls its shard from (pure: tested with exact values).

A tensor-parallel engine's handle names one KV sender per rank (``KVHandle.address``: the
ranks' addresses, comma-separated, in rank order) and its rank 0's layout. Today a shard moves
only to the same shard: the same ``tp_size`` on both sides, rank r from rank r (the decode
worker's ``check_handle`` has already refused another ``tp_size`` by name, naming both).
"""

from __future__ import annotations

import dataclasses

from engine.kv_layout import KVCacheLayout, tp_mappable
from kvtransfer.base import KVHandle, KVTransferError, TransferErrorCode

ADDRESS_SEPARATOR = ","


def rank_handles(handle: KVHandle, local: KVCacheLayout) -> list[KVHandle]:
    """One handle per local rank: its source's address and the shard layout both sides hold."""
    if not tp_mappable(handle.layout.tp_size, local.tp_size):
        raise KVTransferError(
            TransferErrorCode.LAYOUT_MISMATCH,
            f"tp_size {handle.layout.tp_size} (prefill) != tp_size {local.tp_size} (decode): "
            "a shard moves only to the same rank of an engine of the same tp_size",
        )
    addresses = handle.address.split(ADDRESS_SEPARATOR)
    if len(addresses) != local.tp_size or not all(addresses):
        raise KVTransferError(
            TransferErrorCode.CORRUPTED,
            f"handle address {handle.address!r} names {len(addresses)} senders for tp_size "
            f"{local.tp_size}",
        )
    return [
        dataclasses.replace(handle, address=address, layout=handle.layout.shard(rank))
        for rank, address in enumerate(addresses)
    ]
