"""The KV store's gRPC service (docs/kv-cache.md, "The store"): a pool of host-memory KV blocks
that workers offload to (``KVStore.Offload``) and pull prompts' prefixes back from, as from a
prefill peer: the store serves the holder half of ``PrefillWorker`` (``LeasePrefix``,
``Release``, ``RenewLease``, ``GetStats``; ``Prefill`` answers UNIMPLEMENTED) and a KV sender of
the cluster's backend, under the same leases (``kvtransfer/lease_manager.py``).

The store holds no model: its KV layout and block hashes come from the checkpoint's config and
the cluster's layout, as the router's do, so an offloaded block of another model or layout is
refused by name and a prompt's blocks hash here as on every worker (``engine/block_hash.py``).
"""

from __future__ import annotations

import logging
import uuid
import zlib

import grpc

from engine.block_hash import hash_blocks, root_hash
from engine.fingerprint import engine_fingerprint
from engine.kv_layout import KVCacheLayout
from engine.model_config import ModelConfig
from engine.spilled_block import MAX_BLOCKS_PER_OFFLOAD
from kvstore_service import store_metrics
from kvstore_service.block_pool import BlockPool
from kvstore_service.config import KVStoreConfig
from kvtransfer import KVSender, SenderOptions, make_sender
from kvtransfer.lease_manager import LeaseManager
from kvtransfer.prefix_holder import PrefixHolderRpcs, lease_prefix_refusal, prefix_lease
from pdserve.cluster.membership import Membership
from pdserve.cluster.registry import WorkerRecord, WorkerState
from pdserve.common.convert import layout_to_proto, remote_layout_mismatch
from pdserve.common.role import Role
from pdserve.common.server import Service
from pdserve.common.wire_version import WIRE_VERSION
from pdserve.v1 import common_pb2, kv_store_pb2, kv_store_pb2_grpc, prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)

_HASH_BYTES = 16


def store_layout(config: KVStoreConfig) -> KVCacheLayout:
    """The KV layout of the cluster's native workers for ``config.model``."""
    mc = ModelConfig.from_dir(config.model)
    layout = config.layout
    return KVCacheLayout(
        model_fingerprint=engine_fingerprint(config.model, layout),
        dtype=layout.dtype.value,
        block_size=layout.block_size,
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        kv_cache_dtype=layout.kv_cache_dtype,
    )


class KVStoreService(
    PrefixHolderRpcs,
    Service,
    kv_store_pb2_grpc.KVStoreServicer,
    prefill_pb2_grpc.PrefillWorkerServicer,
):
    name = "pdserve.v1.KVStore"
    trace_name = "pdserve-kvstore"

    def __init__(self, config: KVStoreConfig) -> None:
        self.config = config
        self.worker_id = config.worker_id or f"{Role.KVSTORE.value}-{uuid.uuid4().hex[:8]}"
        self.leases = LeaseManager(config.lease_s)
        self._pool: BlockPool | None = None
        self._sender: KVSender | None = None
        self._membership: Membership | None = None
        self._max_len = 0
        self._root = b""

    def register(self, server: grpc.aio.Server) -> None:
        kv_store_pb2_grpc.add_KVStoreServicer_to_server(self, server)
        prefill_pb2_grpc.add_PrefillWorkerServicer_to_server(self, server)

    @property
    def pool(self) -> BlockPool:
        if self._pool is None:
            raise RuntimeError("the KV store is not loaded yet")
        return self._pool

    async def _loaded(self, context: grpc.aio.ServicerContext) -> BlockPool:
        if self._pool is None or self.draining:
            state = "draining" if self.draining else "still loading"
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the KV store is {state}")
        assert self._pool is not None
        return self._pool

    async def load(self) -> None:
        layout = store_layout(self.config)
        self._max_len = ModelConfig.from_dir(self.config.model).max_position_embeddings
        pool = BlockPool(layout, int(self.config.capacity_gib * 2**30))
        self._root = root_hash(layout.model_fingerprint)
        options = SenderOptions(
            self.config.server.host,
            self.config.kv_port,
            advertise_host=self.config.server.advertise_host,
            tls=self.config.server.tls,
            max_pull_s=self.config.max_pull_s,
        )
        self._sender = make_sender(self.config.kv_backend, pool.pages, self.leases, options)
        await self._sender.start()
        self.leases.start(pool.free_pinned, self._sender)
        self._pool = pool  # last: no call finds the pool before its sender and leases run
        store_metrics.observe(pool)
        logger.info(
            "kv store: %d blocks of %d bytes (%.1f MiB); kv sender (%s) at %s",
            pool.num_slots,
            layout.block_bytes,
            pool.num_slots * layout.block_bytes / 2**20,
            self._sender.backend,
            self._sender.address,
        )
        if self.config.redis is not None:
            self._membership = Membership(self.config.redis, pool, self.record, self._drain)
            self._membership.start()

    def _drain(self) -> None:
        if self.request_stop is not None:
            self.request_stop()

    def num_inflight(self) -> int:
        return len(self.leases)

    def record(self) -> WorkerRecord:
        pool = self.pool
        return WorkerRecord(
            worker_id=self.worker_id,
            role=Role.KVSTORE,
            address=self.address,
            model_fingerprint=pool.layout.model_fingerprint,
            block_size=pool.layout.block_size,
            num_blocks=pool.num_slots,
            state=WorkerState.DRAINING if self.draining else WorkerState.SERVING,
            num_free_blocks=pool.num_slots - len(pool.index),
            num_cached_blocks=len(pool.index),
            kv_address=self._sender.address if self._sender is not None else "",
        )

    async def drain(self, timeout_s: float, poll_s: float = 0.05) -> None:
        self.draining = True
        if self._membership is not None:
            self._membership.heartbeat_now()
        await super().drain(timeout_s, poll_s)

    async def close(self) -> None:
        if self._membership is not None:
            await self._membership.stop()
        await self.leases.close()  # the reaper, the sender, then what is still leased

    # ---- KVStore ---------------------------------------------------------------------------
    async def Offload(
        self, request: kv_store_pb2.OffloadRequest, context: grpc.aio.ServicerContext
    ) -> kv_store_pb2.OffloadResponse:
        """Every block is checked before any is stored; then each is stored in one call (no
        await between choosing its slot and writing it)."""
        pool = await self._loaded(context)
        mismatch = remote_layout_mismatch(pool.layout, request.layout)
        if mismatch is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"layout: {mismatch}")
        limit = MAX_BLOCKS_PER_OFFLOAD
        if len(request.blocks) > limit:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"blocks: {len(request.blocks)} in one call, at most {limit}",
            )
        for i, block in enumerate(request.blocks):
            why = _block_refusal(block, pool.layout.block_bytes)
            if why is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"blocks[{i}].{why}")
        reply = kv_store_pb2.OffloadResponse()
        for block in request.blocks:
            stored = pool.put(block.block_hash, block.parent_hash, block.data)
            if stored is None:
                reply.num_refused += 1
            elif stored:
                reply.num_stored += 1
            else:
                reply.num_held += 1
        store_metrics.OFFLOADED.labels("stored").inc(reply.num_stored)
        store_metrics.OFFLOADED.labels("held").inc(reply.num_held)
        store_metrics.OFFLOADED.labels("refused").inc(reply.num_refused)
        return reply

    # ---- the holder half of PrefillWorker --------------------------------------------------
    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, "a KV store holds blocks; it computes no prompt"
        )
        raise AssertionError("not reached: abort raises")

    async def LeasePrefix(
        self, request: prefill_pb2.LeasePrefixRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.LeasePrefixResponse:
        """Pins the run of the prompt's blocks it holds from ``first_block`` under a lease of
        its own (id and token made here), as a prefill worker lends its cached prefix."""
        pool = await self._loaded(context)
        size = pool.layout.block_size
        why = lease_prefix_refusal(request, size, self._max_len)
        if why is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        hashes = hash_blocks(self._root, list(request.prompt_token_ids), size)
        lease_id = f"store-{uuid.uuid4().hex}"
        slots = pool.lend(lease_id, hashes[request.first_block :])
        token = self.leases.grant(lease_id, slots) if slots else ""  # no await since the pin
        store_metrics.LENT_BLOCKS.inc(len(slots))
        assert self._sender is not None
        return prefix_lease(self._sender, lease_id, len(slots), self.config.lease_s, token, request)

    async def GetStats(
        self, request: common_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.WorkerStats:
        pool = self.pool
        return common_pb2.WorkerStats(
            num_pinned=pool.index.num_pinned,
            num_blocks=pool.num_slots,
            num_free_blocks=pool.num_slots - len(pool.index),
            num_cached_blocks=len(pool.index),
            block_size=pool.layout.block_size,
            num_inflight=self.num_inflight(),
            draining=self.draining,
            layout=layout_to_proto(pool.layout),
            kv_address=self._sender.address if self._sender is not None else "",
            wire_version=WIRE_VERSION,
        )


def _block_refusal(block: kv_store_pb2.OffloadedBlock, block_bytes: int) -> str | None:
    if len(block.block_hash) != _HASH_BYTES:
        return f"block_hash must be {_HASH_BYTES} bytes, got {len(block.block_hash)}"
    if len(block.parent_hash) not in (0, _HASH_BYTES):
        return f"parent_hash must be empty or {_HASH_BYTES} bytes, got {len(block.parent_hash)}"
    if block.parent_hash == block.block_hash:
        return "parent_hash is the block's own hash"
    if len(block.data) != block_bytes:
        return f"data must be {block_bytes} bytes (one block), got {len(block.data)}"
    if zlib.crc32(block.data) != block.crc32:
        return "crc32 does not match data"
    return None
