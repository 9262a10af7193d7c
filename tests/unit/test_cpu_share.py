"""How ``pdserve up`` shares the machine's cores (``app/cpu_share.py``), exact values."""

from __future__ import annotations

import pytest

from app.cpu_share import CoreShare, rank_cores, worker_threads
from app.settings import parse_service_flags
from engine.config import EngineBackend
from pdserve.common.role import Role
from router.config import RouterConfig


def test_each_rank_gets_cores_of_its_own_then_ranks_share_in_turn() -> None:
    cpus = list(range(8))
    assert rank_cores(cpus, 0, 2, 4) == "0-1|2-3"  # a TP=2 worker of two: half the box
    assert rank_cores(cpus, 2, 2, 4) == "4-5|6-7"
    assert rank_cores(cpus, 0, 1, 1) == "0-7"  # one worker alone: all of it
    assert rank_cores([0, 1], 1, 2, 3) == "1|0"  # more ranks than cores: in turn
    assert rank_cores([2, 3, 7, 8], 0, 1, 1) == "2-3,7-8"  # the cores this process may use
    assert worker_threads("native", 2, 8) == ("--num-threads", "4")
    assert worker_threads("vllm", 2, 8) == ()


def _worker(role: Role, *flags: str):  # type: ignore[no-untyped-def]
    config = parse_service_flags(role, ["--model", "/m", "--engine", "vllm", *flags])
    assert not isinstance(config, RouterConfig)
    return config


def test_pdserve_up_binds_each_vllm_rank_unless_the_operator_chose() -> None:
    prefill = _worker(Role.PREFILL, "--tensor-parallel-size", "2")
    decode = _worker(Role.DECODE)
    share = CoreShare(list(range(6)), skip=False)
    share.plan([(prefill, 1), (decode, 2)])  # four ranks on six cores: one each
    binds = [share.bind(c).engine.vllm.cpu_omp_threads_bind for c in (prefill, decode, decode)]
    assert binds == ["0|1", "2", "3"]
    assert share.bind(decode).engine.vllm.cpu_omp_threads_bind == "4"  # added later: next
    given = _worker(Role.DECODE, "--cpu-omp-threads-bind", "5")
    assert share.bind(given) == given
    native = parse_service_flags(Role.DECODE, ["--model", "/m"])
    assert share.bind(native) == native and native.engine.backend is EngineBackend.NATIVE
    operator = CoreShare(list(range(6)), skip=True)  # VLLM_CPU_OMP_THREADS_BIND set
    assert operator.bind(decode) == decode


def test_a_binding_is_one_core_list_per_rank() -> None:
    with pytest.raises(ValueError, match=r"one core list per rank \(tensor_parallel_size 2\)"):
        _worker(Role.DECODE, "--tensor-parallel-size", "2", "--cpu-omp-threads-bind", "0-3")
    with pytest.raises(ValueError, match="cpu_omp_threads_bind 'a'"):
        _worker(Role.DECODE, "--cpu-omp-threads-bind", "a")
    with pytest.raises(ValueError, match="--cpu-omp-threads-bind"):
        parse_service_flags(Role.DECODE, ["--model", "/m", "--cpu-omp-threads-bind", "0"])
