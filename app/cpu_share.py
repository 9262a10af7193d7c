"""How one ``pdserve up`` shares this machine's CPUs among its workers: each native worker its
share of threads, each vLLM rank its own cores (the rules are pure, with exact-value tests)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

from decode_service.config import DecodeConfig
from engine.config import EngineBackend
from prefill_service.config import PrefillConfig

WorkerConfig = PrefillConfig | DecodeConfig


def worker_threads(engine: str, num_workers: int, num_cpus: int) -> tuple[str, ...]:
    """Each native worker's share of ``num_cpus``, as its ``--num-threads``: the workers of one
    ``pdserve up`` share the CPUs, and OpenMP threads beyond the cores spin against each other.
    vLLM binds its own threads (``CoreShare``). A ``--num-threads`` in ``--prefill-args`` /
    ``--decode-args`` comes later on the command line and wins."""
    if engine != "native":
        return ()
    share = max(1, num_cpus // max(num_workers, 1))
    return ("--num-threads", str(share))


def rank_cores(cpus: Sequence[int], first_rank: int, num_ranks: int, total_ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for a worker whose ranks are numbers ``first_rank ..`` of
    the ``total_ranks`` planned on ``cpus``: each rank ``len(cpus) // total_ranks`` cores of its
    own, at least one (with more ranks than cores, ranks share them in turn)."""
    per = max(1, len(cpus) // max(total_ranks, 1))
    ranks = []
    for rank in range(first_rank, first_rank + num_ranks):
        ids = [cpus[(rank * per + i) % len(cpus)] for i in range(per)]
        ranks.append(_core_list(ids))
    return "|".join(ranks)


def _core_list(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5``."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


class CoreShare:
    """The cores a ``pdserve up`` gives its vLLM workers' ranks, in the order they start (a
    restart keeps its config, so its cores; a worker added later takes the next share, round
    robin). Nothing when the operator chose: a worker's ``--cpu-omp-threads-bind``, or vLLM's
    own ``VLLM_CPU_OMP_THREADS_BIND`` in the environment (``skip``)."""

    def __init__(self, cpus: Sequence[int], skip: bool) -> None:
        self._cpus, self._skip = sorted(cpus), skip
        self._lock = threading.Lock()
        self._next_rank = self._total_ranks = 0

    def plan(self, pools: list[tuple[WorkerConfig, int]]) -> None:
        """The pools about to start: (one worker's config, how many)."""
        self._total_ranks = sum(_ranks(config) * count for config, count in pools)

    def bind(self, config: WorkerConfig) -> WorkerConfig:
        ranks = _ranks(config)
        if not ranks or self._skip:
            return config
        with self._lock:
            first, self._next_rank = self._next_rank, self._next_rank + ranks
        total = max(self._total_ranks, first + ranks)
        vllm = dataclasses.replace(
            config.engine.vllm, cpu_omp_threads_bind=rank_cores(self._cpus, first, ranks, total)
        )
        return dataclasses.replace(config, engine=dataclasses.replace(config.engine, vllm=vllm))


def _ranks(config: WorkerConfig) -> int:
    """The ranks whose cores ``CoreShare`` picks: a vLLM worker's, unless given."""
    engine = config.engine
    if engine.backend is not EngineBackend.VLLM or engine.vllm.cpu_omp_threads_bind is not None:
        return 0
    return engine.vllm.tensor_parallel_size
