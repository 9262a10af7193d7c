"""When speculation pays: per-request acceptance tracking and the batch rule (pure, no torch).

Speculation never changes output, only cost: a verified position that is rejected was compute
spent for nothing. So a request verifies only the guesses likely enough to be kept
(``num_guesses``), speculates at all while its recent acceptance is at least
``min_acceptance``; below it, the request sits out a number of steps that doubles each time a
retry fails again (1, 2, 4, ... ``MAX_BACKOFF_STEPS``) and resets once one succeeds. A batch
with more decoding requests than ``max_batch_size`` does not speculate at all.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_BACKOFF_STEPS = 64
# Weight of the newest verification in the running acceptance rate.
_EWMA_WEIGHT = 0.5


@dataclass
class AcceptanceState:
    """One request's speculation record."""

    rate: float = 1.0  # running acceptance (optimistic start: the first proposal is tried)
    skip_steps: int = 0  # steps left to sit out
    backoff_steps: int = 1  # the next sit-out's length

    def wants_to_speculate(self) -> bool:
        return self.skip_steps == 0

    def num_guesses(self, k: int, min_acceptance: float) -> int:
        """Up to ``k`` guesses, the j-th only if it is likely enough to be kept: a guess
        survives only if every one before it did, so with a per-guess rate ``rate`` the j-th
        is kept with probability about ``rate ** j``, which must clear the bar. Fewer rows
        to verify where guesses often fail: where the step is compute-bound, each costs."""
        num = k
        while num > 1 and self.rate**num < min_acceptance:
            num -= 1
        return num

    def step_skipped(self) -> None:
        """A step on which this request did not speculate because it was sitting out."""
        self.skip_steps = max(self.skip_steps - 1, 0)

    def verified(self, num_proposed: int, num_accepted: int, min_acceptance: float) -> None:
        """Folds one verification in; starts a sit-out when the rate fell below the bar."""
        if num_proposed <= 0:
            return
        fraction = num_accepted / num_proposed
        self.rate = (1 - _EWMA_WEIGHT) * self.rate + _EWMA_WEIGHT * fraction
        if self.rate >= min_acceptance:
            self.backoff_steps = 1
            return
        self.skip_steps = self.backoff_steps
        self.backoff_steps = min(2 * self.backoff_steps, MAX_BACKOFF_STEPS)
        # Back at the bar after the sit-out: one good retry is enough to resume.
        self.rate = min_acceptance


def batch_speculates(num_decoding: int, max_batch_size: int) -> bool:
    """Whether a step decoding ``num_decoding`` requests speculates at all."""
    return 0 < num_decoding <= max_batch_size


def num_to_propose(
    k: int, num_output_tokens: int, max_tokens: int, num_tokens: int, max_model_len: int
) -> int:
    """How many tokens to propose: at most ``k``, and never more than the request can still
    emit after the model's own next token (``max_tokens``, ``max_model_len``)."""
    return max(0, min(k, max_tokens - num_output_tokens - 1, max_model_len - num_tokens - 1))
