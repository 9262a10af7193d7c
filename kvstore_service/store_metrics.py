"""The KV store's Prometheus metrics (docs/observability.md): occupancy, what offloads did, and
what pulls leased. A worker's side of offloading is ``pdserve_kv_store_offloads_total``
(``pdserve/common/metrics.py``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from kvstore_service.block_pool import BlockPool

BLOCKS = Gauge("pdserve_kvstore_blocks", "Blocks the KV store holds, by state", ["state"])
OFFLOADED = Counter(
    "pdserve_kvstore_offloaded_blocks_total",
    "Blocks workers offloaded here, by result (stored, held already, refused: no slot)",
    ["result"],
)
EVICTED = Gauge("pdserve_kvstore_evicted_blocks", "Blocks evicted since the store started")
LENT_BLOCKS = Counter("pdserve_kvstore_lent_blocks_total", "Blocks leased to pulls")
LEASES = Gauge("pdserve_kvstore_leases", "Leases of pulls in flight")


def observe(pool: BlockPool) -> None:
    """Gauges read at scrape time."""
    index = pool.index
    BLOCKS.labels("capacity").set_function(lambda: index.num_slots)
    BLOCKS.labels("held").set_function(lambda: len(index))
    BLOCKS.labels("pinned").set_function(lambda: index.num_pinned)
    EVICTED.set_function(lambda: index.num_evicted)
    LEASES.set_function(lambda: pool.num_lent)
