"""A discrete-event simulator of a pdserve cluster in simulated time: the router (its own
routing functions, ``router/policy.py``), a prefill pool and a decode pool, or colocated
workers, each a ``SimWorker`` running pdserve's scheduler and block manager, with step and
transfer times from a ``Profile``. Pure: no I/O, no wall clock.

A disaggregated request: arrival (+ router overhead) -> prefill worker (cache_aware or least
loaded) -> its first token goes to the client when the prefill step ends -> the least-loaded
decode worker reserves blocks (waiting, in arrival order, while it has none) -> the transfer
(``Profile.transfer_s``) -> the prefill worker frees its pinned blocks, the decode worker
continues. A prompt with fewer than ``local_prefill_tokens`` uncached tokens on the decode
worker caching most of it is prefilled there, as the router's conditional disaggregation
does. Colocated workers do both phases; requests go to the least-loaded one.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from app.bench.stats import RequestRecord
from app.bench.workload import BenchRequest, poisson_arrivals
from app.capacity.profile import Profile
from app.capacity.sim_worker import Outcome, SimWorker, StepResult, WorkerKind, new_sequence
from engine.block_hash import root_hash
from engine.sequence import SequenceStatus
from native_engine.paged_sequence import PagedSequence
from router.policy import WorkerLoad, rank_cache_aware, rank_decode, rank_prefill

__all__ = ["ClusterShape", "RouterModel", "SimResult", "Simulator", "poisson_arrivals"]


@dataclass(frozen=True)
class ClusterShape:
    num_prefill: int = 0
    num_decode: int = 0
    num_colocated: int = 0

    def __post_init__(self) -> None:
        disaggregated = self.num_prefill > 0 or self.num_decode > 0
        if min(self.num_prefill, self.num_decode, self.num_colocated) < 0:
            raise ValueError("worker counts must be >= 0")
        if disaggregated and (self.num_prefill < 1 or self.num_decode < 1):
            raise ValueError("a disaggregated cluster needs --prefill >= 1 and --decode >= 1")
        if disaggregated == (self.num_colocated > 0):
            raise ValueError("simulate either --prefill N --decode M or --colocated K")

    @property
    def num_workers(self) -> int:
        return self.num_prefill + self.num_decode + self.num_colocated

    @property
    def label(self) -> str:
        if self.num_colocated:
            return f"colocated x{self.num_colocated}"
        return f"{self.num_prefill}P:{self.num_decode}D"


@dataclass(frozen=True)
class RouterModel:
    prefill_policy: str = "cache_aware"  # or least_loaded
    cache_alpha: float = 1.0
    imbalance_tokens: int = 8192
    local_prefill_tokens: int = 32


@dataclass
class _Request:
    record: RequestRecord
    seq: PagedSequence  # where it is prefilled (or all of it, when one worker does both)
    prefill: SimWorker | None = None
    decode: SimWorker | None = None
    decode_seq: PagedSequence | None = None  # the decode worker's own, for a prefilled request


@dataclass
class SimResult:
    records: list[RequestRecord]
    duration_s: float
    num_steps: dict[str, int] = field(default_factory=dict)


class Simulator:
    """``shared_cores``: every worker shares that many CPU cores (one host, as on a development
    box) instead of having its own hardware (a GPU each): a step that starts while ``k``
    processes are busy (itself included) takes ``max(1, k / shared_cores)`` times its
    profiled time, the share fixed when the step starts (a coarse processor-sharing model).
    The busy processes are the workers in a step and, while any request is in flight, the
    serving processes on the same cores (the router relaying tokens and the load's client
    reading them: ``serving_processes``, one by default)."""

    def __init__(
        self,
        profile: Profile,
        shape: ClusterShape,
        router: RouterModel,
        shared_cores: int | None = None,
        serving_processes: float = 1.0,
    ) -> None:
        if shared_cores is not None and shared_cores < 1:
            raise ValueError(f"shared_cores must be >= 1, got {shared_cores}")
        if serving_processes < 0:
            raise ValueError(f"serving_processes must be >= 0, got {serving_processes}")
        self.serving_processes = serving_processes
        self._num_in_flight = 0  # requests routed and not finished
        self.profile = profile
        self.router = router
        self.shared_cores = shared_cores
        root = root_hash(profile.model_fingerprint or "pdserve-sim")
        make = lambda role, i: SimWorker(f"{role.value}-{i}", role, profile, root)  # noqa: E731
        self.prefill = [make(WorkerKind.PREFILL, i) for i in range(shape.num_prefill)]
        self.decode = [make(WorkerKind.DECODE, i) for i in range(shape.num_decode)]
        self.decode += [make(WorkerKind.COLOCATED, i) for i in range(shape.num_colocated)]
        self.now_s = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._by_seq: dict[int, _Request] = {}
        self._admissions: dict[str, deque[_Request]] = {w.name: deque() for w in self.decode}
        self._turn = 0

    # ---- the event loop -------------------------------------------------------------------
    def at(self, time_s: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (time_s, next(self._order), action))

    def run(self, requests: list[BenchRequest], arrivals_s: list[float]) -> SimResult:
        if len(requests) != len(arrivals_s):
            raise ValueError(f"{len(requests)} requests, {len(arrivals_s)} arrival times")
        for i, (request, arrival_s) in enumerate(zip(requests, arrivals_s, strict=True)):
            if not request.prompt_token_ids:
                raise ValueError("the simulator needs token-id prompts (tokenize text first)")
            record = RequestRecord(i, request.num_prompt_tokens, arrival_s)
            seq = new_sequence(f"sim-{i}", list(request.prompt_token_ids), request.output_len)
            req = _Request(record, seq)
            self._by_seq[id(seq)] = req
            self.at(arrival_s + self.profile.router_overhead_s, functools.partial(self._route, req))
        while self._events:
            self.now_s, _, action = heapq.heappop(self._events)
            action()
        by_index = {r.record.index: r.record for r in self._by_seq.values()}
        records = [by_index[i] for i in sorted(by_index)]
        end_s = max((r.chunk_times_s[-1] for r in records if r.chunk_times_s), default=0.0)
        steps = {w.name: w.num_steps for w in [*self.prefill, *self.decode]}
        return SimResult(records, max(end_s, 1e-9), steps)

    def _wake(self, worker: SimWorker) -> None:
        """New work for ``worker``: it steps once every event of this instant is in (requests
        arriving together are batched together, as an engine woken by them would)."""
        self.at(self.now_s, lambda: self._kick(worker))

    def _kick(self, worker: SimWorker) -> None:
        if worker.busy:
            return
        duration_s = worker.begin_step()
        if duration_s is None:
            return
        if self.shared_cores is not None:
            busy: float = sum(w.busy for w in [*self.prefill, *self.decode])  # this one too
            busy += self.serving_processes if self._num_in_flight else 0.0
            duration_s *= max(1.0, busy / self.shared_cores)
        self.at(self.now_s + duration_s, lambda: self._end_step(worker))

    def _end_step(self, worker: SimWorker) -> None:
        for result in worker.end_step():
            self._deliver(worker, result)
        self._admit(worker)
        self._kick(worker)

    # ---- the router -----------------------------------------------------------------------
    def _loads(self, workers: list[SimWorker], req: _Request | None = None) -> list[WorkerLoad]:
        return [
            WorkerLoad(
                w.name,
                w.num_inflight
                + (len(self._admissions[w.name]) if w.name in self._admissions else 0),
                w.block_manager.num_free_blocks,
                self.profile.num_blocks,
                self.profile.block_size,
                queued_prefill_tokens=sum(
                    s.num_tokens - s.num_computed_tokens for s in w.scheduler.waiting
                ),
            )
            for w in workers
        ]

    def _route(self, req: _Request) -> None:
        self._turn += 1
        self._num_in_flight += 1
        seq = req.seq
        if not self.prefill:  # colocated
            worker = self._pick_decode(seq)
            req.decode = worker
            worker.add(seq, prefill_only=False)
            self._wake(worker)
            return
        local = self._local_prefill(seq)
        if local is not None:  # little uncached: prefilled where it decodes
            req.decode = local
            local.add(seq, prefill_only=False)
            self._wake(local)
            return
        cached = {w.name: w.cached_tokens(seq) for w in self.prefill}
        loads = self._loads(self.prefill)
        if self.router.prefill_policy == "cache_aware":
            order = rank_cache_aware(
                loads, cached, self.router.cache_alpha, self.router.imbalance_tokens, self._turn
            ).order
        else:
            order = rank_prefill(loads, self._turn)
        worker = next(w for w in self.prefill if w.name == order[0])
        req.prefill = worker
        worker.add(seq, prefill_only=True)
        self._wake(worker)

    def _local_prefill(self, seq: PagedSequence) -> SimWorker | None:
        """The router's conditional disaggregation (``router/dispatch.py``): among the ranked
        decode workers the one caching most of the prompt, when fewer than
        ``local_prefill_tokens`` of it are uncached there."""
        threshold = self.router.local_prefill_tokens
        if threshold <= 0:
            return None
        order = rank_decode(self._loads(self.decode), seq.num_tokens, self._turn)
        ranked = [next(w for w in self.decode if w.name == name) for name in order]
        if not ranked:
            return None
        cached = {w.name: w.cached_tokens(seq) for w in ranked}
        best = max(ranked, key=lambda w: cached[w.name])  # ties: the ranked order
        return best if seq.num_tokens - cached[best.name] < threshold else None

    def _pick_decode(self, seq: PagedSequence) -> SimWorker:
        order = rank_decode(self._loads(self.decode), seq.num_tokens, self._turn)
        if not order:  # no worker could ever hold it: the least loaded drops it as "length"
            return self.decode[0]
        return next(w for w in self.decode if w.name == order[0])

    # ---- request progress -----------------------------------------------------------------
    def _deliver(self, worker: SimWorker, result: StepResult) -> None:
        req = self._by_seq[id(result.seq)]
        req.record.chunk_times_s.append(self.now_s)
        req.record.num_output_tokens += 1
        if result.outcome is Outcome.FINISHED:
            self._num_in_flight -= 1
        if result.outcome is not Outcome.PREFILLED:
            return
        if req.seq.status is SequenceStatus.FINISHED_LENGTH:  # ended at its first token
            self._num_in_flight -= 1
            worker.free_pinned(req.seq)
            return
        decode = self._pick_decode(req.seq)
        req.decode = decode
        req.decode_seq = new_sequence(
            req.seq.request_id, req.seq.prompt_token_ids, req.seq.params.max_tokens
        )
        self._by_seq[id(req.decode_seq)] = req
        self._admissions[decode.name].append(req)
        self._admit(decode)

    def _admit(self, decode: SimWorker) -> None:
        """Decode admission in arrival order: reserve blocks, then the transfer."""
        queue = self._admissions.get(decode.name)
        while queue:
            head = queue[0]
            assert head.decode_seq is not None
            if not decode.reserve(head.decode_seq):
                return
            queue.popleft()
            transfer_s = self.profile.transfer_s(head.seq.num_prompt_tokens)
            self.at(self.now_s + transfer_s, functools.partial(self._transferred, head))

    def _transferred(self, req: _Request) -> None:
        assert req.prefill is not None and req.decode is not None
        assert req.decode_seq is not None
        req.prefill.free_pinned(req.seq)
        self._wake(req.prefill)  # the freed blocks may admit waiting prompts
        if req.decode.start_prefilled(req.decode_seq) is Outcome.TOKEN:
            self._wake(req.decode)
        else:
            self._admit(req.decode)
