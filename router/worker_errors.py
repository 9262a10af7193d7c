"""The errors a call to a worker ends in, as the router raises them: ``WorkerError`` (the
client's, already phrased) and ``WorkerLost`` (a worker failed: migrate). Which one a failed
call becomes is the failure table's to say (``router/failures.py``)."""

from __future__ import annotations

import grpc

from router.failures import Action, Event, Phase, Seen, Verdict, classify, event_of
from router.plan import Plan, Route, Unserved
from router.worker import Worker


class WorkerError(Exception):
    """A worker's failure, already phrased for the client. ``never``: no worker could ever
    serve this request (too large for any of them): retrying is pointless."""

    def __init__(self, code: grpc.StatusCode, message: str, never: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.never = never


class WorkerLost(WorkerError):
    """A worker failed (a ``MIGRATE`` verdict of ``router/failures.py``): another worker can
    take the request over. The next attempt avoids ``avoid`` (the worker, and the prefill
    worker whose KV failed). With a ``QUARANTINE`` verdict, the worker's last words say the
    request killed it: no other worker takes it."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        verdict: Verdict,
        address: str,
        *,
        also_avoid: tuple[str, ...] = (),
    ) -> None:
        super().__init__(code, message)
        self.verdict = verdict
        self.address = address
        self.avoid = (address, *also_avoid)


def worker_error(exc: grpc.aio.AioRpcError, what: str) -> WorkerError:
    code = exc.code()
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
        return WorkerError(code, exc.details() or code.name)
    return WorkerError(code, f"{what}: {exc.details() or code.name}")


def failure(
    exc: grpc.aio.AioRpcError,
    worker: Worker,
    what: str,
    verdict: Verdict,
    also_avoid: tuple[str, ...] = (),
) -> WorkerError:
    """What a failed call raises for its verdict: ``WorkerLost`` (migrate, or quarantine: the
    caller acts on the verdict), else the client's error. A ``NEXT`` verdict is the caller's
    to act on before it gets here."""
    error = worker_error(exc, what)
    if verdict.action not in (Action.MIGRATE, Action.QUARANTINE):
        return error
    return WorkerLost(error.code, error.message, verdict, worker.address, also_avoid=also_avoid)


def stalled(worker: Worker, what: str, phase: Phase) -> WorkerLost:
    message = f"{worker.role.value} worker {worker.address}: {what}"
    verdict = classify(phase, Seen.STALL)
    return WorkerLost(grpc.StatusCode.UNAVAILABLE, message, verdict, worker.address)


def event(exc: grpc.aio.AioRpcError) -> Event:
    """A failed call's event for the failure table: its code, or what its trailers name."""
    return event_of(exc.code(), tuple(exc.trailing_metadata() or ()))


def unserved(chosen: Plan, num_prompt_tokens: int) -> WorkerError:
    """The refusal of a plan with no worker to start with, by its cause."""
    kind = "colocated" if chosen.route is Route.COLOCATED else "prefill"
    if chosen.unserved is Unserved.TOO_LARGE:
        return WorkerError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"no {kind} worker can hold {num_prompt_tokens} prompt tokens",
            never=True,
        )
    if chosen.unserved is Unserved.NO_PAIR:
        return WorkerError(
            grpc.StatusCode.UNAVAILABLE,
            "no healthy decode worker can take a healthy prefill worker's KV: their tensor "
            "parallelism or page arrangement does not map (engine/kv_shards.py, docs/engines.md)",
        )
    return WorkerError(grpc.StatusCode.UNAVAILABLE, f"no healthy {kind} worker")
