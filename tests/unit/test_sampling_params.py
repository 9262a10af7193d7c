"""engine/sampling_params.py: validation on construction, defaults and normalisation."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from engine.sampling_params import MAX_LOGPROBS, SamplingParams


def test_defaults() -> None:
    p = SamplingParams()
    assert p.max_tokens == 16
    assert p.temperature == 1.0
    assert p.top_p == 1.0
    assert p.top_k == -1
    assert p.min_p == 0.0
    assert p.seed is None
    assert p.stop == ()
    assert p.stop_token_ids == ()
    assert p.ignore_eos is False
    assert p.logprobs is None
    assert p.greedy is False
    assert p.stop_strings == ()
    assert p.stop_ids == ()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("temperature", -0.1),
        ("temperature", "0.5"),
        ("top_p", 0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -0.5),
        ("top_k", -2),
        ("top_k", 1.5),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("max_tokens", 0),
        ("max_tokens", -1),
        ("max_tokens", 1.5),
        ("max_tokens", True),
        ("max_tokens", "16"),
        ("seed", -1),
        ("seed", 1.0),
        ("seed", True),
        ("logprobs", -1),
        ("logprobs", MAX_LOGPROBS + 1),
        ("logprobs", 1.5),
        ("stop", [""]),
        ("stop", ["ok", ""]),
        ("stop", ""),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [2, -1]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", [True]),
    ],
)
def test_invalid_value_raises_value_error_naming_the_parameter(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


def test_logprobs_upper_bound_is_twenty() -> None:
    assert MAX_LOGPROBS == 20
    with pytest.raises(ValueError, match=r"logprobs must be <= 20, got 21"):
        SamplingParams(logprobs=21)


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p"])
def test_nan_float_parameter_is_rejected(name: str) -> None:
    # top_p and min_p reject NaN (every comparison with NaN is False); temperature must too: a
    # NaN temperature turns every logit into NaN in the sampler.
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: math.nan})


@pytest.mark.parametrize(("name", "value"), [("stop", 5), ("stop_token_ids", 5)])
def test_non_iterable_stop_raises_value_error_naming_the_parameter(name: str, value: int) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0},
        {"temperature": 0.0},
        {"temperature": 2.5},
        {"top_p": 1},
        {"top_p": 1e-6},
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 50},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"max_tokens": 1},
        {"seed": 0},
        {"seed": 2**40},
        {"logprobs": 0},
        {"logprobs": 20},
        {"stop_token_ids": [0, 2]},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict[str, Any]) -> None:
    p = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        if key == "stop_token_ids":
            assert p.stop_token_ids == tuple(value)
        else:
            assert getattr(p, key) == value


def test_single_stop_string_is_normalised_to_tuple() -> None:
    p = SamplingParams(stop="###")
    assert p.stop == ("###",)
    assert p.stop_strings == ("###",)


def test_stop_lists_are_normalised_to_tuples() -> None:
    p = SamplingParams(stop=["a", "bc"], stop_token_ids=[7, 8])
    assert p.stop == ("a", "bc")
    assert p.stop_token_ids == (7, 8)
    assert p.stop_strings == ("a", "bc")
    assert p.stop_ids == (7, 8)


def test_params_are_frozen_and_hashable() -> None:
    p = SamplingParams(stop=["x"], stop_token_ids=[1])
    assert hash(p) == hash(SamplingParams(stop=("x",), stop_token_ids=(1,)))
    assert p == SamplingParams(stop="x", stop_token_ids=(1,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("temperature", "greedy"),
    # Below 1e-5 a temperature would overflow fp32 logits: treated as greedy (as vLLM does).
    [(0, True), (0.0, True), (1e-9, True), (1e-5, False), (0.7, False), (1.0, False)],
)
def test_greedy_property(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).greedy is greedy
