"""Speculative decoding's pure core: n-gram lookup, the adaptivity rule, how many tokens to
propose, the config's named refusals, and rolling back speculative slots (exact values)."""

from __future__ import annotations

import pytest

from engine.config import SpecMethod, SpeculativeConfig
from engine.sampling_params import SamplingParams
from native_engine.block_manager import BlockManager
from native_engine.ngram_proposer import NgramProposer, ngram_lookup
from native_engine.paged_sequence import PagedSequence
from native_engine.proposer import ProposalRequest
from native_engine.spec_policy import (
    MAX_BACKOFF_STEPS,
    AcceptanceState,
    batch_speculates,
    num_to_propose,
)


@pytest.mark.parametrize(
    ("tokens", "n_min", "n_max", "k", "expected"),
    [
        ([1, 2, 3, 9, 1, 2], 1, 3, 2, [3, 9]),  # the 2-gram [1, 2] occurred at 0
        ([1, 2, 3, 9, 1, 2], 3, 3, 2, []),  # no earlier [9, 1, 2]
        ([5, 6, 7, 5, 6, 8, 5, 6], 2, 2, 3, [8, 5, 6]),  # the latest occurrence wins
        ([5, 6, 7, 5, 6, 8, 5, 6], 2, 2, 9, [8, 5, 6]),  # up to the end, no further
        ([4, 4, 4], 1, 2, 3, [4]),  # the suffix [4, 4] occurred at 0, followed by [4]
        ([7], 1, 4, 3, []),  # nothing before the suffix
        ([1, 2, 3, 4, 1, 2, 3], 2, 4, 2, [4, 1]),  # the longest n first: [1, 2, 3]
    ],
)
def test_ngram_lookup(
    tokens: list[int], n_min: int, n_max: int, k: int, expected: list[int]
) -> None:
    assert ngram_lookup(tokens, n_min, n_max, k) == expected


def test_ngram_proposer_reads_prompt_and_output() -> None:
    seq = PagedSequence("r", [10, 11, 12, 13], SamplingParams(), [10, 11, 12, 13, 99, 10, 11])
    proposer = NgramProposer(2, 3)
    assert proposer.propose([ProposalRequest(seq, 3), ProposalRequest(seq, 1)]) == [
        [12, 13, 99],
        [12],
    ]


def test_acceptance_state_backs_off_doubling_and_resumes_after_one_good_retry() -> None:
    state = AcceptanceState()
    assert state.wants_to_speculate() and state.rate == 1.0
    state.verified(4, 4, 0.3)
    assert state.rate == 1.0 and state.wants_to_speculate()
    state.verified(4, 0, 0.3)  # 0.5: still above the bar
    assert state.rate == 0.5 and state.wants_to_speculate()
    state.verified(4, 0, 0.3)  # 0.25 < 0.3: sit out 1 step
    assert (state.skip_steps, state.backoff_steps, state.rate) == (1, 2, 0.3)
    state.step_skipped()
    assert state.wants_to_speculate()
    state.verified(4, 0, 0.3)  # 0.15: sit out 2
    assert (state.skip_steps, state.backoff_steps) == (2, 4)
    state.step_skipped()
    assert not state.wants_to_speculate()
    state.step_skipped()
    state.verified(4, 2, 0.3)  # 0.4 >= 0.3: resumed, backoff reset
    assert (state.skip_steps, state.backoff_steps, state.rate) == (0, 1, 0.4)
    for _ in range(20):
        state.verified(4, 0, 0.3)
        state.skip_steps = 0
    assert state.backoff_steps == MAX_BACKOFF_STEPS
    state.verified(0, 0, 0.3)  # nothing proposed: nothing learned
    assert state.backoff_steps == MAX_BACKOFF_STEPS


def test_guesses_shrink_to_those_likely_enough_to_be_kept() -> None:
    state = AcceptanceState()
    assert state.num_guesses(4, 0.3) == 4  # 1.0 ** 4
    state.rate = 0.85
    assert state.num_guesses(4, 0.3) == 4  # 0.85 ** 4 = 0.52
    state.rate = 0.6
    assert state.num_guesses(4, 0.3) == 2  # 0.6 ** 2 = 0.36, 0.6 ** 3 = 0.22
    state.rate = 0.31
    assert state.num_guesses(4, 0.3) == 1  # always at least one while speculating
    assert state.num_guesses(1, 0.3) == 1


def test_batch_rule_and_proposal_length() -> None:
    assert [batch_speculates(n, 8) for n in (0, 1, 8, 9)] == [False, True, True, False]
    # k, num_output, max_tokens, num_tokens, max_model_len
    assert num_to_propose(4, 0, 100, 10, 1000) == 4
    assert num_to_propose(4, 5, 8, 10, 1000) == 2  # 3 left to emit: 2 guesses + 1 own
    assert num_to_propose(4, 7, 8, 10, 1000) == 0  # the last token is the model's own
    assert num_to_propose(4, 0, 100, 997, 1000) == 2  # room for 3 more tokens in the model


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 17}, "num_speculative_tokens"),
        ({"ngram_min": 3, "ngram_max": 2}, "spec_ngram_min"),
        ({"ngram_min": 0}, "spec_ngram_min"),
        ({"draft_model": "/m"}, "spec_draft_model"),
        ({"min_acceptance": 1.5}, "spec_min_acceptance"),
        ({"max_batch_size": 0}, "spec_max_batch_size"),
    ],
)
def test_speculative_config_refuses_by_name(kwargs: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        SpeculativeConfig(SpecMethod.NGRAM, **kwargs)


def test_a_draft_method_needs_its_model() -> None:
    with pytest.raises(ValueError, match="spec_draft_model"):
        SpeculativeConfig(SpecMethod.DRAFT)


def test_trim_returns_the_speculative_tail_blocks_first_in_line() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    seq = PagedSequence("r", [1, 2, 3, 4, 5], SamplingParams())
    assert bm.allocate_slots(seq, 5)  # blocks 0, 1
    seq.num_computed_tokens = 4  # one token left to compute, then 4 guesses: 9 slots
    assert bm.allocate_slots(seq, 5)
    assert seq.block_table == [0, 1, 2] and bm.num_free_blocks == 5
    bm.trim(seq, 6)  # 1 guess accepted: 6 tokens computed, 2 blocks kept
    assert seq.block_table == [0, 1] and bm.num_free_blocks == 6
    other = PagedSequence("s", [9], SamplingParams())
    assert bm.allocate_slots(other, 1)
    assert other.block_table == [2]  # the trimmed block is first in line again
    bm.trim(seq, 8)
    assert seq.block_table == [0, 1]  # nothing beyond what 8 tokens need


def test_the_incremental_proposer_finds_what_a_plain_scan_finds() -> None:
    """Against a reference scan, on sequences growing token by token (small alphabets make
    repeats and byte-level false matches across token boundaries common)."""
    import random

    def scan(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
        for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
            suffix = tokens[len(tokens) - n :]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + k]
        return []

    rng = random.Random(0)
    proposer = NgramProposer(1, 3)
    for trial in range(20):
        alphabet = [rng.choice([1, 256, 257, 65536, 65537, 2**24 + 1]) for _ in range(4)]
        seq = PagedSequence(f"r{trial}", [rng.choice(alphabet)], SamplingParams())
        for _ in range(60):
            seq.token_ids.append(rng.choice(alphabet))
            (got,) = proposer.propose([ProposalRequest(seq, 3)])
            assert got == scan(seq.token_ids, 1, 3, 3)
        proposer.release(seq.request_id)
    assert not proposer._packed
