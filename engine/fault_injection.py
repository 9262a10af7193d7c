"""Faults a native engine injects on request, for the tests that show what the rest of the
system does about them (``EngineConfig.fault_stall_at_step``, ``fault_raise_on_token``; the
worker's own ``fault_exit_on_token`` is a process exit, ``pdserve/worker/service.py``).

- A stuck step: step number N blocks outside the GIL for good, as a hung device sync does.
- An engine fault: a step holding a request whose prompt holds the token raises once it ran,
  as a failure in batched code would (the native engine: ``around_step``), or the delivery of
  such a request's output raises (the vLLM engine: ``check``); the engine's last words then
  name the requests in it (``engine/serving_engine.py`` ``FaultEvidence``).
Called by the engines from their step thread (``around_step``) and their event loop (the rest).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class FaultInjection:
    stall_at_step: int | None = None
    raise_on_token: int | None = None
    _marked: set[str] = field(default_factory=set)  # requests whose prompt holds the token

    def admitted(self, request_id: str, prompt_ids: list[int]) -> None:
        if self.raise_on_token is not None and self.raise_on_token in prompt_ids:
            self._marked.add(request_id)

    def ended(self, request_id: str) -> None:
        self._marked.discard(request_id)

    def check(self, request_id: str) -> None:
        """Raises when ``request_id``'s prompt holds the token."""
        if request_id in self._marked:
            raise RuntimeError(f"fault injection: a request holding token {self.raise_on_token}")

    def around_step(
        self,
        step_number: int,
        step: Callable[[], T],
        stepping: Callable[[], frozenset[str] | None],
    ) -> T:
        """Runs ``step`` (number ``step_number``), stalling before it or raising after it as
        configured; ``stepping``: the request ids the step held."""
        if self.stall_at_step == step_number:
            logger.error("fault injection: step %d blocks for good", step_number)
            threading.Event().wait()  # outside the GIL, like a hung device sync
        result = step()
        if self._marked & (stepping() or frozenset()):
            raise RuntimeError(f"fault injection: a step holding token {self.raise_on_token}")
        return result
