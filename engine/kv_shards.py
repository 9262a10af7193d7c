"""Which KV heads a tensor-parallel rank holds, and which reads fill a decode rank from a
prefill engine of another ``tp_size`` (pure, torch-free: the router's pairing, the decode
worker's pull and the sender's check use these rules; exact-value tests in
``tests/unit/test_kv_shards.py``).

A tensor-parallel engine of ``tp_size`` t splits the model's H KV heads in t equal, ordered
ranges: rank r holds heads ``[r * H/t, (r+1) * H/t)`` (vLLM's column-parallel QKV). A *shard*
is such a range, named by a layout whose ``tp_size`` is the number of ranges and ``tp_rank``
the range (``num_kv_heads``: its heads). What moves between a prefill engine of p ranks and a
decode engine of d ranks is always a shard of ``n = max(p, d)``:

- d >= p (k = d / p): decode rank r reads shard r of d, held by prefill rank ``r // k`` as its
  local heads ``[(r % k) * H/d, ...)``: the decode rank's whole page.
- p > d (k = p / d): decode rank r reads shards ``r*k .. r*k + k-1`` of p, each a prefill
  rank's whole page, written at its local heads ``[i * H/p, ...)``.

Equal ``tp_size`` is rank r from rank r. Refused by name before any block moves: sizes that do
not divide, and replicated KV heads (``tp_size`` above the model's KV head count: each rank holds
a copy, not a range) with unequal sizes. Vocabulary as vLLM's ``TransferTopology``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.kv_layout import KVCacheLayout


def tp_refusal(
    prefill_tp: int, prefill_heads: int, decode_tp: int, decode_heads: int
) -> str | None:
    """None when a decode engine of ``decode_tp`` ranks (``decode_heads`` KV heads each) can
    take a prefill engine's shards, else why not (the one rule: the router's pairing, the
    decode worker's check, ``shard_reads``)."""
    if prefill_tp == decode_tp:
        if prefill_heads != decode_heads:
            return f"num_kv_heads per rank {prefill_heads} (prefill) != {decode_heads} (decode)"
        return None
    low, high = sorted((prefill_tp, decode_tp))
    if high % low:
        return (
            f"tp_size {prefill_tp} (prefill) and tp_size {decode_tp} (decode) do not divide "
            "one another: a decode rank's heads would span a part of a prefill rank's"
        )
    if prefill_tp * prefill_heads != decode_tp * decode_heads:
        return (
            f"tp_size {high} is above the model's KV head count (tp_size {prefill_tp} x "
            f"{prefill_heads} heads (prefill) != tp_size {decode_tp} x {decode_heads} heads "
            "(decode)): replicated KV heads move only between equal tp_size"
        )
    return None


def tp_mappable(prefill_tp: int, prefill_heads: int, decode_tp: int, decode_heads: int) -> bool:
    return tp_refusal(prefill_tp, prefill_heads, decode_tp, decode_heads) is None


def shard_mismatch(prefill: KVCacheLayout, decode: KVCacheLayout) -> str | None:
    """None when a decode rank of layout ``decode`` can take the KV of a prefill engine whose
    rank 0 has layout ``prefill`` (a handle's), else why not: the tp rule, then every other
    field (the model's whole KV, heads summed over ranks, must be the same)."""
    refused = tp_refusal(prefill.tp_size, prefill.num_kv_heads, decode.tp_size, decode.num_kv_heads)
    if refused is not None:
        return refused
    return _whole(decode).mismatch(_whole(prefill))


@dataclass(frozen=True)
class ShardRead:
    """One read of a decode rank's pull: the shard ``layout`` (what both sides of this read
    hold) from prefill rank ``source_rank``."""

    source_rank: int
    layout: KVCacheLayout


def shard_reads(prefill: KVCacheLayout, decode: KVCacheLayout) -> list[ShardRead]:
    """The reads that fill decode rank ``decode.tp_rank``'s pages from a prefill engine whose
    rank 0 has layout ``prefill``. Raises ``ValueError`` (``shard_mismatch``'s reason)."""
    refused = shard_mismatch(prefill, decode)
    if refused is not None:
        raise ValueError(refused)
    p, d, r = prefill.tp_size, decode.tp_size, decode.tp_rank
    if d >= p:
        return [ShardRead(r // (d // p), decode)]
    k = p // d
    heads = decode.num_kv_heads // k
    return [
        ShardRead(s, dataclasses.replace(decode, num_kv_heads=heads, tp_size=p, tp_rank=s))
        for s in range(r * k, (r + 1) * k)
    ]


def head_range(own: KVCacheLayout, shard: KVCacheLayout) -> tuple[int, int]:
    """``(first, count)``: which of a rank's local heads (layout ``own``) hold ``shard``, one
    read's layout (``shard_reads``), on the sending or the receiving side. Raises
    ``ValueError`` naming why the rank does not hold it."""
    n, t = shard.tp_size, own.tp_size
    if n == t:
        mismatch = own.mismatch(shard)
        if mismatch is not None:
            raise ValueError(mismatch)
        return 0, own.num_kv_heads
    if n < t or n % t or own.num_kv_heads != shard.num_kv_heads * (n // t):
        refused = tp_refusal(t, own.num_kv_heads, n, shard.num_kv_heads) or (
            f"a shard of tp_size {n} is larger than a rank of tp_size {t}'s"
        )
        raise ValueError(f"{refused} (local layout {own} != remote layout {shard})")
    k = n // t
    if shard.tp_rank // k != own.tp_rank:
        raise ValueError(
            f"shard {shard.tp_rank} of tp_size {n} is held by rank {shard.tp_rank // k}, "
            f"not by rank {own.tp_rank} of tp_size {t}"
        )
    mismatch = _whole(own).mismatch(_whole(shard))
    if mismatch is not None:
        raise ValueError(mismatch)
    return (shard.tp_rank % k) * shard.num_kv_heads, shard.num_kv_heads


def _whole(layout: KVCacheLayout) -> KVCacheLayout:
    """The layout with the tensor-parallel split undone (all heads, one rank): what two
    engines of different ``tp_size`` must agree on."""
    return dataclasses.replace(
        layout, num_kv_heads=layout.num_kv_heads * layout.tp_size, tp_size=1, tp_rank=0
    )
