"""How the vLLM engine (``vllm_engine/engine.py``) drives vLLM's engine core, wherever it runs
(``engine.config.VllmEngineCore``):

- ``WorkerCore`` (``vllm_engine/worker_core.py``): the engine core in the worker's process,
  stepped from a thread of the engine's; every other call runs between steps.
- ``ProcessCore`` (``vllm_engine/process_core.py``): the engine core in a process of its own,
  stepping itself, driven through vLLM's public client (``AsyncLLM``); what pdserve needs of it
  comes through vLLM's stat loggers, its KV-event publisher and the connector's hub.

Everything here is called on the worker's event loop. The driver owns the engine core's
lifetime (``close`` ends it); the request table decides what is added and aborted.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from vllm import SamplingParams as VllmParams
from vllm.distributed.kv_events import EventBatch
from vllm.outputs import RequestOutput

from engine.request_error import RequestError
from engine.step_progress import StepProgress

T = TypeVar("T")


def refusal(rid: str, exc: Exception) -> RequestError:
    """vLLM refused to add ``rid`` (its input checks: ``VLLMValidationError`` is not a
    ``ValueError``): that request's own error, named; the engine goes on."""
    return RequestError(f"vLLM refused request {rid!r}: {exc}")


@dataclass(frozen=True)
class CoreCallbacks:
    """What a driver tells the engine: outputs to deliver (one step's, in order), that the
    state it reads changed (``refresh``: stats, events), that vLLM refused to add one request
    (``refuse``: its input, not the engine: that request alone fails), and that the engine
    core died."""

    deliver: Callable[[list[RequestOutput]], None]
    refresh: Callable[[], None]
    refuse: Callable[[str, Exception], None]
    die: Callable[[BaseException], None]


class CoreDriver(ABC):
    """Built by ``vllm_engine/builder.py``, owned by one ``VllmEngine``."""

    def __init__(self, max_model_len: int, vocab_size: int) -> None:
        self.progress = StepProgress()
        self.max_model_len, self.vocab_size = max_model_len, vocab_size  # vLLM's model's

    @abstractmethod
    def start(self, callbacks: CoreCallbacks) -> None:
        """Starts the driver's tasks; outputs flow to ``callbacks`` until ``close``."""

    @abstractmethod
    async def close(self) -> None:
        """Ends the engine core (and its processes, if any)."""

    @abstractmethod
    async def call(self, fn: Callable[[], T]) -> T:
        """Runs ``fn`` where it may ``add`` and ``abort`` (between steps, when the engine core
        steps in this process), then refreshes."""

    @abstractmethod
    def add(self, rid: str, prompt_token_ids: list[int], params: VllmParams, priority: int) -> None:
        """Adds a request (in order with ``abort``: an abort never overtakes its add) at
        ``priority`` (vLLM's: its scheduler reads it under ``--scheduling-policy priority``,
        ``SchedulerConfig.scheduling_policy``). vLLM's
        refusal of its input is the request's ``refusal``: raised here where the add is
        synchronous, else given to ``CoreCallbacks.refuse``."""

    @abstractmethod
    def abort(self, rids: list[str]) -> None:
        """Aborts requests; their outputs still in flight are dropped."""

    @property
    @abstractmethod
    def num_blocks(self) -> int:
        """Blocks of the KV cache, vLLM's null block left out."""

    @abstractmethod
    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests in vLLM's scheduler, as last seen."""

    @abstractmethod
    def num_free_blocks(self) -> int:
        """Free blocks of the KV cache, as last seen."""

    @abstractmethod
    def take_event_batches(self) -> list[EventBatch]:
        """vLLM's KV cache events since the last call."""
