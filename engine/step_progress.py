"""Whether an engine makes progress: the liveness signal a heartbeat cannot give.

Heartbeats come from the event loop, which keeps running while a step is blocked outside the
GIL (a hung device sync, a host-tier copy that never completes, a step thread that never gets
a thread). So an engine's loop marks when it starts working toward a step (``working``) and
when it completes one or goes idle (``progressed``); ``stalled_s`` is how long it has had
work without completing a step. Workers report it in their stats (the router stops routing to
a worker stalled for its ``stall_timeout_s`` and migrates its streams) and fail their
liveness health past ``engine_stall_s`` (``pdserve/worker/service.py``).

Every engine's loop owns one (``engine/step_loop.py``, and vLLM's own-process engine core's
driver, ``vllm_engine/process_core.py``); only that loop writes it, anything on the event loop
reads it.
"""

from __future__ import annotations

import time


class StepProgress:
    def __init__(self) -> None:
        self._working_since: float | None = None
        self.num_steps = 0  # steps completed

    def working(self) -> None:
        """The loop has work and heads for a step (it may first wait for a copy or a thread)."""
        if self._working_since is None:
            self._working_since = time.monotonic()

    def progressed(self, stepped: bool) -> None:
        """A step completed (``stepped``), or the loop found nothing to run and waits."""
        self.num_steps += stepped
        self._working_since = None

    def stalled_s(self, now: float | None = None) -> float:
        """Seconds with work and no step completed (0: progressing, or idle)."""
        if self._working_since is None:
            return 0.0
        return max((time.monotonic() if now is None else now) - self._working_since, 0.0)
