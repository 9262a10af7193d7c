"""The trailer a worker's failed call carries when its engine died: the engine's last words on
the call's request (``engine.serving_engine.FaultEvidence``: alone in the failed step, in it
with others, or not in it). Written by the worker services, read by the router's failure table
(``router/failures.py``): a request that crashed a worker alone is not tried again, one that was
only there goes on without a strike. No trailer (a process killed, a segfault, a connection
cut) reads as a silent loss, which the router cannot tell from a crash."""

from __future__ import annotations

from engine.serving_engine import FaultEvidence

ENGINE_FAULT = "pdserve-engine-fault"


def engine_fault_trailers(evidence: FaultEvidence) -> tuple[tuple[str, str], ...]:
    """The trailing metadata of a call whose request ``evidence`` describes."""
    if evidence is FaultEvidence.UNKNOWN:
        return ()
    return ((ENGINE_FAULT, evidence.value),)


def evidence_of(trailers: tuple[tuple[str, str], ...]) -> FaultEvidence | None:
    """What a failed call's trailers say the dead engine knew of its request; None: no word
    (or a value this router does not know)."""
    for key, value in trailers:
        if key == ENGINE_FAULT:
            try:
                return FaultEvidence(value)
            except ValueError:
                return None
    return None
