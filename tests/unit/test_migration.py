"""Migration and supervision decisions: pure functions, exact values."""

from __future__ import annotations

import pytest

from app.local_cluster import restart_delay_s
from engine.sampling_params import SamplingParams
from router.migration import Continuation, Finished, attempt_id, continue_request
from router.policy import is_stalled

EOS = (2,)
P = SamplingParams(max_tokens=5)


def test_the_continuation_carries_what_the_client_already_has() -> None:
    step = continue_request([7, 8, 9], [4, 5], P, EOS, max_model_len=64, stopped=False)
    assert step == Continuation([7, 8, 9, 4, 5], num_generated_tokens=2)
    assert continue_request([7], [], P, EOS, 64, False) == Continuation([7], 0)


@pytest.mark.parametrize(
    ("delivered", "max_model_len", "stopped", "finish"),
    [
        ([4, 5, 6, 7, 8], 64, False, "length"),  # max_tokens already delivered
        ([4, 5], 5, False, "length"),  # 3 + 2 tokens fill max_model_len
        ([4, 2], 64, False, "stop"),  # the last token was EOS
        ([4, 5], 64, True, "stop"),  # a stop string completed in the relayed text
    ],
)
def test_a_request_the_delivered_tokens_already_end_is_finished_not_migrated(
    delivered: list[int], max_model_len: int, stopped: bool, finish: str
) -> None:
    got = continue_request([7, 8, 9], delivered, P, EOS, max_model_len, stopped)
    assert got == Finished(finish)


def test_each_attempt_has_its_own_worker_request_id() -> None:
    assert [attempt_id("abc-1234", n) for n in range(3)] == [
        "abc-1234",
        "abc-1234-m1",
        "abc-1234-m2",
    ]


def test_a_worker_is_stalled_after_three_timeouts_or_one_once_its_record_expired() -> None:
    assert [is_stalled(n, record_expired=False) for n in range(5)] == [
        False, False, False, True, True
    ]  # fmt: skip
    assert [is_stalled(n, record_expired=True) for n in range(3)] == [False, True, True]


def test_restart_delays_double_to_the_cap() -> None:
    assert [restart_delay_s(n, 1.0, 30.0) for n in range(7)] == [1, 2, 4, 8, 16, 30, 30]
