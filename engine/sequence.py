"""Request state inside the engine: token ids, block table, progress, status."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.block_hash import BlockHash, hash_blocks
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
    block_table: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache (prefix hits included).
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at first admission (both tiers), and of
    # them those loaded from the host tier.
    num_cached_tokens: int = -1
    num_host_cached_tokens: int = 0
    # Chained hashes of every full block of token_ids (computed eagerly as tokens arrive).
    block_hashes: list[BlockHash] = field(default_factory=list)
    # Blocks of block_table already published to the prefix cache.
    num_registered_blocks: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Prefill-only requests keep their blocks pinned after the first token (disaggregation).
    prefill_only: bool = False
    # Guided decoding (``params.structured``): the matcher its output has advanced.
    guide: Guide | None = None
    # ``params.prompt_logprobs`` on the engine that prefills the client's prompt (not a
    # continuation's): entry i is prompt token i + 1's, filled as the prefill runs.
    wants_prompt_logprobs: bool = False
    # The scheduler's clock (``schedule(now)``: time.monotonic() in an engine) when it first
    # admitted this sequence: where its queueing ended (router/phases.py).
    first_scheduled_s: float | None = None
    # Speculation: guesses verified for this request and the ones it kept (request traces).
    num_spec_proposed_tokens: int = 0
    num_spec_accepted_tokens: int = 0
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
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs still to compute: no prefix-cache hit may skip their positions."""
        return self.wants_prompt_logprobs and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def num_prompt_tokens_in(self, num_new_tokens: int) -> int:
        """How many of the next ``num_new_tokens`` tokens to compute are prompt tokens."""
        done = min(self.num_prompt_tokens, self.num_computed_tokens + num_new_tokens)
        return max(0, done - self.num_computed_tokens)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    def update_block_hashes(self, root: BlockHash, block_size: int) -> None:
        """Extend ``block_hashes`` to cover every full block of ``token_ids``."""
        if len(self.token_ids) // block_size <= len(self.block_hashes):
            return
        parent = self.block_hashes[-1] if self.block_hashes else None
        self.block_hashes.extend(
            hash_blocks(root, self.token_ids, block_size, len(self.block_hashes), parent)
        )

    def reset_for_recompute(self) -> None:
        """Preempted: its blocks are gone; prompt and outputs so far are recomputed later."""
        self.block_table = []
        self.num_computed_tokens = 0
        self.num_registered_blocks = 0
        self.status = SequenceStatus.WAITING
