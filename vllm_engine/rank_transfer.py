"""The KV sender and receiver of a tensor-parallel vLLM engine, as its worker's services see
them (``kvtransfer.sharded``): facades over one real sender or receiver per rank, each in its
rank's process over that rank's shard (``vllm_engine/rank_runtime.py``), driven through the
``RankHub``.

- ``RankKVSender``: starts a sender in every rank; its address, the one its handles name, is the
  ranks' addresses in rank order (``kvtransfer/shard_receiver.py``), so a decode worker's "KV
  only from a known prefill worker's own sender" check compares it whole. The lease table stays the
  prefill service's: the ranks check out through the hub.
- ``RankKVReceiver``: a pull is one pull per rank, into the same block ids (vLLM's block ids are
  the same in every rank): each rank reads its heads from the prefill ranks that hold them
  (``engine/kv_shards.py``, ``kvtransfer/shard_receiver.py``). It returns or raises only once
  every rank has stopped writing (the receiver contract, ``kvtransfer/base.py``): the first
  failure, or a cancel, cancels the others and waits for them.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence

import grpc

from engine.kv_layout import KVCacheLayout
from kvtransfer import ReceiverOptions, SenderOptions
from kvtransfer.base import (
    BlockLeases,
    KVHandle,
    KVSender,
    KVTransferError,
    TransferErrorCode,
    TransferStats,
)
from kvtransfer.shard_receiver import ADDRESS_SEPARATOR, MapsShards, settle
from kvtransfer.wire import handle_to_proto
from pdserve.common.tracing import TraceContext
from pdserve.v1 import engine_hub_pb2 as hub_pb2
from vllm_engine.rank_hub import RANK_CALL_TIMEOUT_S, Rank, RankHub
from vllm_engine.rank_runtime import RANK_BACKENDS, tls_to_proto

logger = logging.getLogger(__name__)


def check_rank_backend(backend: str) -> None:
    """What a rank cannot move its shard with, refused by name before anything starts."""
    if backend not in RANK_BACKENDS:
        raise ValueError(
            f"kv_backend {backend!r} with tensor_parallel_size > 1: a vLLM rank moves its "
            f"shard with {' or '.join(RANK_BACKENDS)} (docs/engines.md)"
        )


class RankKVSender(KVSender):
    def __init__(
        self, hub: RankHub, backend: str, leases: BlockLeases, options: SenderOptions
    ) -> None:
        check_rank_backend(backend)
        self.backend = backend
        self.leases = leases
        self._hub, self._options = hub, options
        self._address = ""

    @property
    def layout(self) -> KVCacheLayout:
        return self._hub.layout

    @property
    def address(self) -> str:
        return self._address

    async def start(self) -> None:
        self._hub.leases = self.leases
        o = self._options

        def start(rank: Rank) -> hub_pb2.StartRankSender:
            return hub_pb2.StartRankSender(
                backend=self.backend,
                host=o.host,
                port=o.port + rank.tp_rank if o.port else 0,  # --kv-port: one port per rank
                advertise_host=o.advertise_host or "",
                max_pull_s=o.max_pull_s,
                tls=tls_to_proto(o.tls),
                no_verify=not o.verify,
                ucx_tls=o.ucx_tls or "",
            )

        replies = await asyncio.gather(
            *(
                r.stub.StartSender(start(r), timeout=RANK_CALL_TIMEOUT_S)
                for r in _in_order(self._hub)
            )
        )
        self._address = ADDRESS_SEPARATOR.join(reply.address for reply in replies)

    async def stop(self) -> None:
        return None  # the ranks' senders stop with their processes


class RankKVReceiver(MapsShards):
    def __init__(self, hub: RankHub, backend: str, options: ReceiverOptions) -> None:
        check_rank_backend(backend)
        self.backend = backend
        self._hub, self._options = hub, options
        self._started: asyncio.Task[None] | None = None

    @property
    def layout(self) -> KVCacheLayout:
        return self._hub.layout

    async def pull(
        self, handle: KVHandle, block_ids: list[int], trace: TraceContext = ()
    ) -> TransferStats:
        self.check_shard_handle(handle, block_ids)  # refused here, before any rank starts
        await self._start_receivers()
        ranks = _in_order(self._hub)
        headers = [hub_pb2.TraceHeader(key=k, value=v) for k, v in trace]
        pull_id = uuid.uuid4().hex

        async def pull(rank: Rank) -> hub_pb2.RankPulled:
            request = hub_pb2.RankPull(
                handle=handle_to_proto(handle), block_ids=block_ids, trace=headers, pull_id=pull_id
            )
            # The rank's pull is bounded by its receiver's timeout; this bounds the call.
            timeout_s = self._options.timeout_s + RANK_CALL_TIMEOUT_S
            return await rank.stub.Pull(request, timeout=timeout_s)

        pulls = [asyncio.create_task(pull(r)) for r in ranks]
        replies: list[hub_pb2.RankPulled] = []
        try:
            for done in asyncio.as_completed(pulls):
                try:
                    reply = await done
                except grpc.aio.AioRpcError as exc:  # a rank gone: its engine is dying
                    raise KVTransferError(
                        TransferErrorCode.UNAVAILABLE, f"a rank's pull: {exc.details()}"
                    ) from None
                if reply.error_code:
                    code = TransferErrorCode(reply.error_code)
                    raise KVTransferError(code, reply.error_message)
                replies.append(reply)
        except BaseException:
            await settle([asyncio.ensure_future(self._cancel(ranks, pull_id, pulls))])
            raise
        return TransferStats(sum(r.num_bytes for r in replies), max(r.duration_s for r in replies))

    async def retain_peers(self, kv_addresses: set[str]) -> None:
        if self._started is None:
            return
        addresses = sorted({a for joined in kv_addresses for a in joined.split(ADDRESS_SEPARATOR)})
        request = hub_pb2.RankPeers(kv_addresses=addresses)
        await asyncio.gather(
            *(
                r.stub.RetainPeers(request, timeout=RANK_CALL_TIMEOUT_S)
                for r in _in_order(self._hub)
            )
        )

    async def _start_receivers(self) -> None:
        if self._started is None:
            o = self._options
            request = hub_pb2.StartRankReceiver(
                backend=self.backend,
                timeout_s=o.timeout_s,
                tls=tls_to_proto(o.tls),
                no_verify=not o.verify,
                ucx_tls=o.ucx_tls or "",
            )

            async def start() -> None:
                await asyncio.gather(
                    *(
                        r.stub.StartReceiver(request, timeout=RANK_CALL_TIMEOUT_S)
                        for r in _in_order(self._hub)
                    )
                )

            self._started = asyncio.ensure_future(start())
        await asyncio.shield(self._started)

    async def _cancel(
        self, ranks: Sequence[Rank], pull_id: str, pulls: list[asyncio.Task[hub_pb2.RankPulled]]
    ) -> None:
        """Every rank stopped writing: each answers ``Cancel`` once its pull ended (or refuses
        the pull if it comes later), asked again while it is busy, up to its pull's own bound;
        a rank gone (its process dead) writes nothing. Past the bound the rank is stuck, and
        its engine with it (the stall bound takes the worker out): logged, not waited for."""
        request = hub_pb2.RankCancel(pull_id=pull_id)
        deadline = asyncio.get_running_loop().time() + self._options.timeout_s
        deadline += 2 * RANK_CALL_TIMEOUT_S

        async def cancel(rank: Rank) -> None:
            while True:
                try:
                    await rank.stub.Cancel(request, timeout=RANK_CALL_TIMEOUT_S)
                    return
                except grpc.aio.AioRpcError as exc:
                    if exc.code() is not grpc.StatusCode.DEADLINE_EXCEEDED:
                        return  # gone (UNAVAILABLE): nothing of it writes any more
                    if asyncio.get_running_loop().time() > deadline:
                        logger.error("rank %d did not stop pull %s", rank.tp_rank, pull_id)
                        return

        await asyncio.gather(*(cancel(r) for r in ranks))
        for pull in pulls:
            pull.cancel()
        await asyncio.gather(*pulls, return_exceptions=True)


def _in_order(hub: RankHub) -> list[Rank]:
    return [hub.ranks[r] for r in range(hub.tp_size)]
