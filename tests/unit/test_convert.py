"""Proto <-> engine conversion: defaults, field-naming errors, float32 round trip."""

from __future__ import annotations

import pytest

from engine.kv_layout import KVCacheLayout
from engine.sampling_params import SamplingParams
from pdserve.common.convert import (
    layout_from_proto,
    layout_to_proto,
    sampling_from_proto,
    sampling_to_proto,
)
from pdserve.v1 import common_pb2


def test_unset_fields_keep_engine_defaults() -> None:
    assert sampling_from_proto(common_pb2.SamplingParams()) == SamplingParams()


def test_real_values_cross_the_wire_exactly() -> None:
    # Doubles, not float32: the engine samples with exactly what the client sent.
    msg = common_pb2.SamplingParams(temperature=0.123456789, top_p=0.987654321, min_p=1e-9)
    wire = common_pb2.SamplingParams.FromString(msg.SerializeToString())
    params = sampling_from_proto(wire)
    assert (params.temperature, params.top_p, params.min_p) == (0.123456789, 0.987654321, 1e-9)


def test_round_trip() -> None:
    params = SamplingParams(
        max_tokens=7,
        temperature=0.5,
        top_p=0.8,
        top_k=20,
        min_p=0.1,
        seed=42,
        stop=("\n\n",),
        stop_token_ids=(2,),
        ignore_eos=True,
        logprobs=3,
    )
    assert sampling_from_proto(sampling_to_proto(params)) == params


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 2.0}, "min_p"),
        ({"logprobs": 99}, "logprobs"),
    ],
)
def test_invalid_fields_are_named(fields: dict[str, float], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        sampling_from_proto(common_pb2.SamplingParams(**fields))  # type: ignore[arg-type]


def test_layout_round_trip() -> None:
    layout = KVCacheLayout("llama:abc:float32:bs16", "float32", 16, 2, 4, 32)
    assert layout_from_proto(layout_to_proto(layout)) == layout
