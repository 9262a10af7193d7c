"""The simulator against closed forms: exact event times for one request on each path, and
the M/D/1 queue (one server, deterministic service, Poisson arrivals) within 5 %."""

from __future__ import annotations

import random

import pytest

from app.bench.stats import summarize
from app.bench.workload import BenchRequest
from app.capacity.profile import (
    DECODE_FEATURES,
    PREFILL_FEATURES,
    TRANSFER_FEATURES,
    LinearFit,
    Profile,
)
from app.capacity.simulator import (
    ClusterShape,
    RouterModel,
    Simulator,
    poisson_arrivals,
)


def constant_profile(
    prefill_s: float, decode_s: float, transfer_s: float = 0.0, max_num_seqs: int = 8
) -> Profile:
    return Profile(
        prefill=LinearFit(PREFILL_FEATURES, prefill_s, (0.0, 0.0)),
        decode=LinearFit(DECODE_FEATURES, decode_s, (0.0, 0.0)),
        transfer=LinearFit(TRANSFER_FEATURES, transfer_s, (0.0,)),
        kv_bytes_per_token=1024,
        block_size=16,
        num_blocks=1024,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=2048,
    )


def _prompt(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(16, 1000) for _ in range(n))


def test_one_request_on_each_path_has_exact_event_times() -> None:
    profile = constant_profile(prefill_s=0.1, decode_s=0.01, transfer_s=0.05)
    rng = random.Random(0)
    long_prompt = BenchRequest(_prompt(rng, 64), output_len=3)
    short_prompt = BenchRequest(_prompt(rng, 20), output_len=3)
    disaggregated = Simulator(profile, ClusterShape(1, 1), RouterModel())
    result = disaggregated.run([long_prompt], [0.0])
    # Prefill step ends at 0.1 (token 1), the transfer at 0.15, two decode steps.
    assert result.records[0].chunk_times_s == pytest.approx([0.1, 0.16, 0.17])
    assert result.num_steps == {"prefill-0": 1, "decode-0": 2}
    # <= local_prefill_tokens uncached: prefilled on the decode worker, no transfer.
    local = Simulator(profile, ClusterShape(1, 1), RouterModel()).run([short_prompt], [1.0])
    assert local.records[0].chunk_times_s == pytest.approx([1.1, 1.11, 1.12])
    assert local.num_steps == {"prefill-0": 0, "decode-0": 3}
    # Colocated: both phases on one worker.
    colocated = Simulator(profile, ClusterShape(num_colocated=1), RouterModel())
    assert colocated.run([long_prompt], [0.0]).records[0].chunk_times_s == pytest.approx(
        [0.1, 0.11, 0.12]
    )


def test_a_decode_worker_batches_prefilled_requests_and_frees_everything() -> None:
    profile = constant_profile(prefill_s=0.1, decode_s=0.01)
    rng = random.Random(1)
    requests = [BenchRequest(_prompt(rng, 48), output_len=5) for _ in range(4)]
    sim = Simulator(profile, ClusterShape(1, 1), RouterModel(prefill_policy="least_loaded"))
    result = sim.run(requests, [0.0] * 4)
    # One prefill step for all four (2048-token budget), then four decode steps of the batch.
    assert [r.chunk_times_s for r in result.records] == [
        pytest.approx([0.1, 0.11, 0.12, 0.13, 0.14])
    ] * 4
    for worker in [*sim.prefill, *sim.decode]:
        worker.block_manager.check_no_leaks()
        assert worker.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("rho", [0.5, 0.7])
def test_a_single_server_queue_matches_the_m_d_1_mean_wait(rho: float) -> None:
    step_s, output_len = 0.01, 4
    service_s = output_len * step_s  # one prefill step (token 1) + 3 decode steps
    rate = rho / service_s
    num = 20_000
    profile = constant_profile(step_s, step_s, max_num_seqs=1)
    rng = random.Random(2)
    requests = [BenchRequest(_prompt(rng, 8), output_len=output_len) for _ in range(num)]
    sim = Simulator(profile, ClusterShape(num_colocated=1), RouterModel())
    result = sim.run(requests, poisson_arrivals(num, rate, seed=3))
    waits = [r.ttft_s - step_s for r in result.records]
    expected = rho * service_s / (2 * (1 - rho))  # Pollaczek-Khinchine, deterministic service
    mean = sum(waits) / num
    assert mean == pytest.approx(expected, rel=0.05), (mean, expected)
    summary = summarize(result.records, result.duration_s)
    assert summary.num_completed == num
    assert summary.tpot_s.p50 == pytest.approx(step_s)


def test_arrivals_are_the_bench_runners() -> None:
    rng = random.Random(7)
    gaps = [rng.expovariate(2.0) for _ in range(3)]
    assert poisson_arrivals(3, 2.0, 7) == pytest.approx(
        [gaps[0], gaps[0] + gaps[1], gaps[0] + gaps[1] + gaps[2]]
    )


def test_workers_sharing_cores_slow_each_other_down() -> None:
    profile = constant_profile(prefill_s=0.1, decode_s=0.01)
    rng = random.Random(4)
    requests = [BenchRequest(_prompt(rng, 64), output_len=2) for _ in range(2)]
    # Two colocated workers, one request each at once: on their own hardware, in parallel.
    alone = Simulator(profile, ClusterShape(num_colocated=2), RouterModel()).run(
        requests, [0.0, 0.0]
    )
    assert [r.chunk_times_s for r in alone.records] == [pytest.approx([0.1, 0.11])] * 2
    # On one shared core a step that starts while the other worker is busy takes twice as
    # long: the first worker starts alone (0.1 s), the second while it runs (0.2 s); the
    # first's decode step starts while the second is busy (0.02 s), the second's after the
    # first has finished (0.01 s).
    # (No serving processes on the core here.)
    shape = ClusterShape(num_colocated=2)
    shared = Simulator(profile, shape, RouterModel(), shared_cores=1, serving_processes=0)
    result = shared.run(requests, [0.0, 0.0])
    assert result.records[0].chunk_times_s == pytest.approx([0.1, 0.12])
    assert result.records[1].chunk_times_s == pytest.approx([0.2, 0.21])
    # The router and the client on the same core count as one more busy process while any
    # request is in flight: the first prefill starts with 2 busy (0.2 s), the second with 3
    # (0.3 s); the first's decode step with 3 (0.03 s: 0.23), the second's once the first
    # finished, with 2 (0.02 s: 0.32).
    served = Simulator(profile, shape, RouterModel(), shared_cores=1).run(requests, [0.0, 0.0])
    assert served.records[0].chunk_times_s == pytest.approx([0.2, 0.23])
    assert served.records[1].chunk_times_s == pytest.approx([0.3, 0.32])
    with pytest.raises(ValueError, match="serving_processes"):
        Simulator(profile, shape, RouterModel(), shared_cores=1, serving_processes=-1)
    with pytest.raises(ValueError, match="shared_cores"):
        Simulator(profile, ClusterShape(num_colocated=1), RouterModel(), shared_cores=0)
