"""A request's tokens inside any engine: prompt and output ids, status, logprobs, its grammar's
matcher and what its updates report (cache hits, speculation). Every engine behind the serving
contract keeps one per request (``engine/request_state.py`` appends to it); the native engine's
paged bookkeeping (block table, computed tokens, block hashes) extends it in
``native_engine/paged_sequence.py``."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.guide import Guide


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # The request's own parameters ended it (engine/request_error.py): never on the wire as a
    # finish reason; the worker answers INVALID_ARGUMENT with the message.
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


_FINISHED = {
    SequenceStatus.FINISHED_STOPPED,
    SequenceStatus.FINISHED_LENGTH,
    SequenceStatus.FINISHED_ABORTED,
    SequenceStatus.FINISHED_ERROR,
}


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprob of the sampled token and the top-n alternatives (raw model distribution)."""

    token_id: int
    logprob: float
    top_token_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Prompt followed by every generated token.
    token_ids: list[int] = field(default_factory=list)
    # Prompt tokens served from the prefix cache at first admission (both tiers), and of
    # them those loaded from the host tier.
    num_cached_tokens: int = -1
    num_host_cached_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Guided decoding (``params.structured``): the matcher its output has advanced.
    guide: Guide | None = None
    # The scheduler's clock (``schedule(now)``: time.monotonic() in an engine) when it first
    # admitted this sequence: where its queueing ended (router/phases.py).
    first_scheduled_s: float | None = None
    # Speculation: guesses verified for this request and the ones it kept (request traces).
    num_spec_proposed_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    # ``params.prompt_logprobs``: entry i is prompt token i + 1's.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]
