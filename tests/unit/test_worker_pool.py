"""The router's pool follows the registry: joins, drains, departures; mismatched KV layouts and
wire versions are refused; static workers stay."""

from __future__ import annotations

import asyncio

from pdserve.cluster.registry import WorkerRecord, WorkerState
from pdserve.common.role import Role
from pdserve.common.wire_version import WIRE_VERSION
from router.worker import worker_refusal
from router.worker_pool import WorkerPool

FP = "LlamaForCausalLM:abc:float32:bs16"


def _record(worker_id: str, role: Role, port: int, **kw: object) -> WorkerRecord:
    fields: dict[str, object] = {
        "worker_id": worker_id,
        "role": role,
        "address": f"127.0.0.1:{port}",
        "model_fingerprint": FP,
        "block_size": 16,
        "num_blocks": 64,
        **kw,
    }
    return WorkerRecord(**fields)  # type: ignore[arg-type]


def test_sync_follows_the_registry() -> None:
    async def run() -> None:
        pool = WorkerPool(prefill=("127.0.0.1:1",), decode=())
        records = [
            _record("p1", Role.PREFILL, 2),
            _record("d1", Role.DECODE, 3),
            _record("d2", Role.DECODE, 4, state=WorkerState.DRAINING),
            _record("bad", Role.DECODE, 5, model_fingerprint="other:fp"),
            _record("bs8", Role.PREFILL, 6, block_size=8),
        ]
        pool.sync(records, FP, 16)
        assert sorted(pool.prefill) == ["127.0.0.1:1", "127.0.0.1:2"]
        assert sorted(pool.decode) == ["127.0.0.1:3", "127.0.0.1:4"]
        assert pool.prefill["127.0.0.1:2"].worker_id == "p1"
        assert pool.decode["127.0.0.1:4"].draining
        assert not pool.decode["127.0.0.1:4"].load().routable
        assert pool.decode["127.0.0.1:3"].load().routable
        # Records gone: the draining worker leaves; a healthy one stays until it also fails its
        # stats check (a Redis restart must not drop live workers); static workers stay.
        pool.sync(records[:1], FP, 16)
        assert sorted(pool.decode) == ["127.0.0.1:3"]
        pool.decode["127.0.0.1:3"].healthy = False
        pool.sync(records[:1], FP, 16)
        assert sorted(pool.prefill) == ["127.0.0.1:1", "127.0.0.1:2"]
        assert pool.decode == {}
        await pool.close()

    asyncio.run(run())


def test_each_pool_turns_its_own_rotation() -> None:
    """One turn per pool per plan (router/plan.py): a shared counter would advance by two per
    request and pin round-robin to every other worker."""

    async def run() -> None:
        pool = WorkerPool(prefill=("127.0.0.1:1", "127.0.0.1:2"), decode=("127.0.0.1:3",))
        for worker in pool.workers:
            worker.healthy = True
        turns = []
        for _ in range(4):
            turns.append(pool.next_turn(Role.PREFILL))
            pool.ranked_decode(10)  # an admission retry turns the decode rotation only
        assert turns == [1, 2, 3, 4]
        assert pool.next_turn(Role.DECODE) == 5
        await pool.close()

    asyncio.run(run())


def test_an_incompatible_worker_taking_over_an_address_replaces_the_old_entry() -> None:
    async def run() -> None:
        pool = WorkerPool()
        pool.sync([_record("d1", Role.DECODE, 3)], FP, 16)
        old = pool.decode["127.0.0.1:3"]
        assert old.healthy
        # The process at that address restarted with another model: it is not that worker.
        pool.sync([_record("d2", Role.DECODE, 3, model_fingerprint="other:fp")], FP, 16)
        assert pool.decode == {} and not old.healthy and old.lost.is_set()
        await pool.close()

    asyncio.run(run())


def test_refusals_and_channels_of_departed_workers_are_forgotten() -> None:
    async def run() -> None:
        pool = WorkerPool()
        bad = _record("bad", Role.DECODE, 5, model_fingerprint="other:fp")
        pool.sync([_record("d1", Role.DECODE, 3), bad], FP, 16)
        assert pool._refused == {"bad": Role.DECODE}
        assert pool.decode["127.0.0.1:3"].decode_stub is not None  # its first call opens a channel
        pool.channels.get("127.0.0.1:9")  # e.g. a release to a prefill worker that left
        await pool.close_unused_channels()
        assert set(pool.channels._channels) == {"127.0.0.1:3"}
        pool.decode["127.0.0.1:3"].set_healthy(False, "test")
        pool.sync([], FP, 16)
        await pool.close_unused_channels()
        assert pool._refused == {} and pool.channels._channels == {}
        await pool.close()

    asyncio.run(run())


def test_a_worker_of_another_wire_version_is_refused_by_name() -> None:
    assert worker_refusal(WIRE_VERSION, FP, 16, FP, 16) is None
    old = f"it speaks wire version 0, this router {WIRE_VERSION}"
    assert worker_refusal(0, FP, 16, FP, 16) == old
    assert worker_refusal(WIRE_VERSION, "other:fp", 16, FP, 16) == (
        f"fingerprint other:fp block_size 16, router has {FP} block_size 16"
    )
    # A record from before versions were sent reads as version 0, and is refused as such.
    raw = {k.encode(): v.encode() for k, v in _record("p0", Role.PREFILL, 7).to_redis().items()}
    del raw[b"wire_version"]
    assert WorkerRecord.from_redis(raw).wire_version == 0

    async def run() -> None:
        pool = WorkerPool(prefill=(), decode=())
        pool.sync([WorkerRecord.from_redis(raw), _record("p1", Role.PREFILL, 8)], FP, 16)
        assert sorted(pool.prefill) == ["127.0.0.1:8"]
        await pool.close()

    asyncio.run(run())
