"""A tensor-parallel engine's KV transfer, rank by rank, without vLLM: two prefill ranks and two
decode ranks (``vllm_engine/rank_runtime.py``, each with its own event loop thread, real gRPC on
Unix sockets, real ``GrpcKVSender``/``GrpcKVReceiver`` over plain tensors shaped like vLLM's CPU
pages), driven through each side's real ``RankHub`` and facades; one lease table, the prefill
side's. Unequal tensor parallelism both ways: a one-rank engine's pages (its front-end's plain
sender, or its ``ShardReceiver``) with a two-rank engine's. Also the layout's tp fields."""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
from pathlib import Path

import pytest
import torch

from engine.kv_layout import KVCacheLayout
from kvtransfer import (
    KVTransferError,
    ReceiverOptions,
    SenderOptions,
    TransferErrorCode,
    make_sender,
)
from kvtransfer.base import BlockLeases, KVHandle, prompt_digest
from kvtransfer.lease_table import LeaseTable
from kvtransfer.shard_receiver import ShardReceiver, source_addresses
from pdserve.common.convert import layout_from_proto, layout_to_proto
from pdserve.common.tls import TlsConfig
from tests.security.tls_util import make_pki
from vllm_engine.bridge import Reports
from vllm_engine.kv_pages import VllmKVPages
from vllm_engine.rank_hub import RankHub
from vllm_engine.rank_runtime import RankRuntime
from vllm_engine.rank_transfer import RankKVReceiver, RankKVSender

NUM_BLOCKS, BLOCK, HEAD_DIM, LAYERS = 8, 4, 8, 2
PAGE = "vllm-test/CPU_ATTN/BHx8x8"
HEADS = 2  # the model's KV heads


def _layout(tp_rank: int = 0, tp_size: int = 2) -> KVCacheLayout:
    heads = HEADS // tp_size
    return KVCacheLayout(
        "fp", "float32", BLOCK, LAYERS, heads, HEAD_DIM, page_layout=PAGE,
        tp_size=tp_size, tp_rank=tp_rank,
    )  # fmt: skip


def test_a_handle_names_one_sender_per_rank() -> None:
    handle = KVHandle("grpc", "h:1,h:2", "r", 3, _layout(), 10.0, "t", b"d")
    assert source_addresses(handle) == ["h:1", "h:2"]
    with pytest.raises(KVTransferError, match=r"names 1 senders for tp_size 2") as one:
        source_addresses(dataclasses.replace(handle, address="h:1"))
    assert one.value.code is TransferErrorCode.CORRUPTED


def test_the_layout_carries_the_shard_and_refuses_another_by_name() -> None:
    assert layout_from_proto(layout_to_proto(_layout(1))) == _layout(1)
    assert _layout(0).shard(1) == _layout(1)
    message = _layout(0).mismatch(_layout(1))
    assert message is not None and message.startswith("tp_rank 0 != 1")
    message = _layout(0, 1).mismatch(_layout(0, 2))
    assert message is not None and message.startswith("num_kv_heads 2 != 1; tp_size 1 != 2")
    with pytest.raises(ValueError, match=r"tp_rank 2 is not in \[0, tp_size 2\)"):
        _layout(2)
    # An older peer's layout (no tp fields) reads as one rank.
    old = layout_to_proto(_layout(0, 1))
    old.ClearField("tp_size")
    assert layout_from_proto(old) == _layout(0, 1)


class _Leases(BlockLeases):
    """The prefill side's one lease table (as the prefill service's ``LeaseManager`` keeps it);
    ``gate`` holds checkouts (a pull in flight at every rank) until it is set."""

    def __init__(self) -> None:
        self.table = LeaseTable(60.0)
        self.readers = self.waiting = 0
        self.gate = asyncio.Event()
        self.gate.set()
        self.held = asyncio.Event()  # set once two checkouts wait at the gate

    async def checkout(self, request_id: str, lease_token: str) -> list[int]:
        self.waiting += 1
        if self.waiting == 2:
            self.held.set()
        await self.gate.wait()
        self.waiting -= 1
        block_ids = self.table.checkout(request_id, lease_token)
        self.readers += 1
        return block_ids

    async def checkin(self, request_id: str) -> None:
        self.readers -= 1
        self.table.checkin(request_id)


def _pages(tp_rank: int, fill: bool, tp_size: int = 2) -> VllmKVPages:
    # vLLM CPU: per block and head, its K then V
    shape = (NUM_BLOCKS, HEADS // tp_size, 2 * BLOCK, HEAD_DIM)
    layers = [torch.randn(shape) if fill else torch.zeros(shape) for _ in range(LAYERS)]
    return VllmKVPages(layers, _layout(tp_rank, tp_size), NUM_BLOCKS)


async def _side(fill: bool) -> tuple[RankHub, list[RankRuntime]]:
    hub = RankHub(2)
    await hub.start()
    runtimes = [RankRuntime(_pages(r, fill), r, hub.address, hub.socket_dir) for r in range(2)]
    # A rank's start blocks its thread until the hub answered: here, off the hub's loop.
    await asyncio.gather(*(asyncio.to_thread(rt.start) for rt in runtimes))
    assert [r.tp_rank for r in await hub.wait_ranks(10.0)] == [0, 1]
    return hub, runtimes


def test_each_rank_pulls_its_own_shard_under_the_one_lease_table() -> None:
    async def run() -> None:
        (p_hub, p_ranks), (d_hub, d_ranks) = await _side(True), await _side(False)
        leases = _Leases()
        sender = RankKVSender(p_hub, "grpc", leases, SenderOptions("127.0.0.1", 0))
        receiver = RankKVReceiver(d_hub, "grpc", ReceiverOptions(30.0))
        try:
            await sender.start()
            assert sender.address.count(",") == 1 and sender.layout == _layout(0)
            leases.table.grant("r", [1, 3, 5], 0.0, "token")
            handle = sender.handle("r", 3, 60.0, "token", prompt_digest([1, 2]))
            assert handle.address == sender.address and handle.layout == _layout(0)
            stats = await receiver.pull(handle, [2, 4, 6])
            assert stats.num_bytes == 2 * 3 * _layout().block_bytes  # both ranks' shards
            for p, d in zip(p_ranks, d_ranks, strict=True):
                for layer in range(LAYERS):
                    want = p.pages.read_layer(layer, [1, 3, 5])
                    assert torch.equal(d.pages.read_layer(layer, [2, 4, 6]), want)
            assert leases.readers == 0  # every rank checked in
            # A wrong token: every rank is refused, NOT_FOUND, and the pull raises it.
            wrong = dataclasses.replace(handle, lease_token="guess")
            with pytest.raises(KVTransferError, match="no lease for request_id 'r'") as refused:
                await receiver.pull(wrong, [2, 4, 6])
            assert refused.value.code is TransferErrorCode.NOT_FOUND and leases.readers == 0
            # Senders named in the wrong order: each rank's layout check names tp_rank.
            swapped = ",".join(reversed(handle.address.split(",")))
            with pytest.raises(KVTransferError, match="tp_rank") as crossed:
                await receiver.pull(dataclasses.replace(handle, address=swapped), [2, 4, 6])
            assert crossed.value.code is TransferErrorCode.LAYOUT_MISMATCH
            # Reports reach every rank, once, for vLLM's next step.
            await p_hub.report(Reports({"internal-r"}, set(), set()))
            for rank in p_ranks:
                assert rank.take_reports().finished_sending == {"internal-r"}
                assert rank.take_reports() == Reports()
        finally:
            for rank in (*p_ranks, *d_ranks):
                await asyncio.to_thread(rank.close)
            await p_hub.close()
            await d_hub.close()

    asyncio.run(run())


def test_a_cancelled_pull_returns_once_every_rank_stopped_writing() -> None:
    async def run() -> None:
        (p_hub, p_ranks), (d_hub, d_ranks) = await _side(True), await _side(False)
        leases = _Leases()
        sender = RankKVSender(p_hub, "grpc", leases, SenderOptions("127.0.0.1", 0))
        receiver = RankKVReceiver(d_hub, "grpc", ReceiverOptions(30.0))
        try:
            await sender.start()
            leases.table.grant("r", [1], 0.0, "token")
            handle = sender.handle("r", 1, 60.0, "token", b"")
            leases.gate.clear()
            pull = asyncio.create_task(receiver.pull(handle, [2]))
            await asyncio.wait_for(leases.held.wait(), 30.0)  # both ranks mid-pull
            pull.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pull
            # Returned: no rank still pulls (each answered Cancel once its pull ended).
            assert all(not rank._pulls for rank in d_ranks)
            leases.gate.set()  # the senders' reads go on and end: every checkout checks in
            async with asyncio.timeout(30.0):
                while leases.readers:
                    await asyncio.sleep(0.05)
        finally:
            for rank in (*p_ranks, *d_ranks):
                await asyncio.to_thread(rank.close)
            await p_hub.close()
            await d_hub.close()

    asyncio.run(run())


def test_ranks_move_their_shards_over_mutual_tls_and_refuse_a_rogue_peer(
    tmp_path: Path,
) -> None:
    """TLS on a rank's KV port is the worker's own (file paths through the hub): each decode
    rank pulls its shard over mTLS; a decode side with another CA's certificate is refused."""
    pki = make_pki(tmp_path / "pki")
    tls = TlsConfig(str(pki.cert), str(pki.key), str(pki.ca))
    rogue = TlsConfig(str(pki.rogue_cert), str(pki.rogue_key), str(pki.ca))

    async def run() -> None:
        (p_hub, p_ranks), (d_hub, d_ranks) = await _side(True), await _side(False)
        (r_hub, r_ranks) = await _side(False)
        leases = _Leases()
        sender = RankKVSender(p_hub, "grpc", leases, SenderOptions("127.0.0.1", 0, tls=tls))
        receiver = RankKVReceiver(d_hub, "grpc", ReceiverOptions(30.0, tls=tls))
        stranger = RankKVReceiver(r_hub, "grpc", ReceiverOptions(5.0, tls=rogue))
        try:
            await sender.start()
            leases.table.grant("r", [1, 3], 0.0, "token")
            handle = sender.handle("r", 2, 60.0, "token", prompt_digest([1, 2]))
            await receiver.pull(handle, [2, 4])
            for p, d in zip(p_ranks, d_ranks, strict=True):
                for layer in range(LAYERS):
                    want = p.pages.read_layer(layer, [1, 3])
                    assert torch.equal(d.pages.read_layer(layer, [2, 4]), want)
            with pytest.raises(KVTransferError) as refused:
                await stranger.pull(handle, [2, 4])
            assert refused.value.code is TransferErrorCode.UNAVAILABLE
            assert leases.readers == 0
        finally:
            for rank in (*p_ranks, *d_ranks, *r_ranks):
                await asyncio.to_thread(rank.close)
            for hub in (p_hub, d_hub, r_hub):
                await hub.close()

    asyncio.run(run())


def test_what_a_rank_cannot_move_is_refused_by_name() -> None:
    with tempfile.TemporaryDirectory():
        hub = RankHub(2)
    with pytest.raises(ValueError, match="kv_backend 'ray' with tensor_parallel_size > 1"):
        RankKVReceiver(hub, "ray", ReceiverOptions(1.0))


def _page(pages: VllmKVPages, layer: int, block: int) -> torch.Tensor:
    return pages._layers[layer][block]  # [heads, 2 * block_size, head_dim]


@pytest.mark.parametrize("backend", ["grpc", "nixl"])
def test_one_rank_and_two_ranks_exchange_kv_both_ways_by_head_ranges(backend: str) -> None:
    """P TP=1 -> D TP=2: each decode rank reads its head of the one prefill rank's pages (the
    sender cuts them; over NIXL, the sender's handshake says where that head range lies). P
    TP=2 -> D TP=1: the one decode engine reads each prefill rank's page into its head range.
    Both under the one lease table of each prefill side; NIXL's digests checked per read."""

    async def run() -> None:
        one_p, one_d = _pages(0, True, tp_size=1), _pages(0, False, tp_size=1)
        (p_hub, p_ranks), (d_hub, d_ranks) = await _side(True), await _side(False)
        leases_one, leases_two = _Leases(), _Leases()
        options = SenderOptions("127.0.0.1", 0)
        plain = make_sender(backend, one_p, leases_one, options)
        two_senders = RankKVSender(p_hub, backend, leases_two, options)
        two_receivers = RankKVReceiver(d_hub, backend, ReceiverOptions(30.0))
        one_receiver = ShardReceiver(backend, one_d, ReceiverOptions(30.0))
        try:
            await plain.start()
            await two_senders.start()
            leases_one.table.grant("a", [1, 3], 0.0, "token")
            handle = plain.handle("a", 2, 60.0, "token", b"")
            stats = await two_receivers.pull(handle, [4, 6])
            assert stats.num_bytes == 2 * _layout(0, 1).block_bytes  # every head, once
            for rank in d_ranks:
                for layer in range(LAYERS):
                    for src, dst in ((1, 4), (3, 6)):
                        head = _page(one_p, layer, src)[rank.tp_rank]
                        assert torch.equal(_page(rank.pages, layer, dst)[0], head)
            leases_two.table.grant("b", [2, 5], 0.0, "token")
            handle = two_senders.handle("b", 2, 60.0, "token", b"")
            stats = await one_receiver.pull(handle, [0, 7])
            assert stats.num_bytes == 2 * _layout(0, 1).block_bytes
            for layer in range(LAYERS):
                for src, dst in ((2, 0), (5, 7)):
                    heads = [_page(rank.pages, layer, src)[0] for rank in p_ranks]
                    assert torch.equal(_page(one_d, layer, dst), torch.stack(heads))
            async with asyncio.timeout(30.0):  # NIXL checks in after the pull returned
                while leases_one.readers or leases_two.readers:
                    await asyncio.sleep(0.01)
            # A handle of a tp_size the pages cannot map: refused by name before any read.
            three = dataclasses.replace(
                handle, address="h:1,h:2,h:3", layout=dataclasses.replace(_layout(0), tp_size=3)
            )
            with pytest.raises(KVTransferError, match="do not divide") as refused:
                await two_receivers.pull(three, [0, 7])
            assert refused.value.code is TransferErrorCode.LAYOUT_MISMATCH
        finally:
            await plain.stop()
            await one_receiver.close()
            for rank in (*p_ranks, *d_ranks):
                await asyncio.to_thread(rank.close)
            await p_hub.close()
            await d_hub.close()

    asyncio.run(run())
