"""``router/limits.py``: the output budget (exact estimates, the refusal that names it) and the
request ids that could forge log lines."""

from __future__ import annotations

import pytest

from router.limits import (
    LOGPROB_BYTES,
    OUTPUT_TOKEN_BYTES,
    RequestLimits,
    check_output,
    check_request_id,
    output_bytes,
)


def test_the_estimate_is_choices_times_tokens_times_what_a_token_weighs() -> None:
    assert (OUTPUT_TOKEN_BYTES, LOGPROB_BYTES) == (24, 48)
    assert output_bytes([100], None) == 100 * 24
    assert output_bytes([100], 0) == 100 * (24 + 48)  # the chosen token's logprob only
    assert output_bytes([100, 50], 20) == 150 * (24 + 48 * 21)


def test_the_probe_that_swamped_the_router_is_refused_by_default() -> None:
    # n=64, top_logprobs=20, no max_tokens on an 8k model: every choice may fill the context.
    with pytest.raises(ValueError, match=r"--max-output-bytes \(268435456\)"):
        check_output([8192] * 64, 20, RequestLimits())


def test_at_the_limit_passes_and_one_byte_over_is_refused() -> None:
    limits = RequestLimits(max_output_bytes=24 * 1000)
    check_output([1000], None, limits)
    with pytest.raises(ValueError, match="1 choice"):
        check_output([1001], None, limits)


@pytest.mark.parametrize("request_id", ["a\nb", "a\rb", "a b", "a\tb", "a\x00b", "a\u2028b"])
def test_a_request_id_that_would_forge_log_lines_is_refused(request_id: str) -> None:
    with pytest.raises(ValueError, match="request_id may not hold"):
        check_request_id(request_id)


@pytest.mark.parametrize("request_id", ["", "req-1", "chatcmpl-9f/+=:.", "ünïcode-id"])
def test_printable_request_ids_pass(request_id: str) -> None:
    check_request_id(request_id)
