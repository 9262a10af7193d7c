"""How one ``pdserve up`` shares this machine's CPUs among its workers (pure)."""

from __future__ import annotations


def worker_threads(engine: str, num_workers: int, num_cpus: int) -> tuple[str, ...]:
    """Each native worker's share of ``num_cpus``, as its ``--num-threads``: the workers of one
    ``pdserve up`` share the CPUs, and OpenMP threads beyond the cores spin against each other.
    vLLM binds its own threads: nothing for it. A ``--num-threads`` in ``--prefill-args`` /
    ``--decode-args`` comes later on the command line and wins."""
    if engine != "native":
        return ()
    share = max(1, num_cpus // max(num_workers, 1))
    return ("--num-threads", str(share))
