"""Each native worker of one `pdserve up` gets its share of the CPUs as --num-threads."""

from __future__ import annotations

from pdserve.app.cpu_share import worker_threads


def test_native_workers_split_the_cpus_and_each_gets_at_least_one() -> None:
    assert worker_threads("native", 2, 16) == ("--num-threads", "8")
    assert worker_threads("native", 3, 16) == ("--num-threads", "5")
    assert worker_threads("native", 4, 2) == ("--num-threads", "1")
    assert worker_threads("native", 0, 2) == ("--num-threads", "2")


def test_vllm_workers_bind_their_own_threads() -> None:
    assert worker_threads("vllm", 2, 16) == ()
