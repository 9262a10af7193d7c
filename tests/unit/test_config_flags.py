"""``app/settings/config_flags.py``: a config's fields as flags (name, type, default, help from
the field), and the parsed flags back as field values, with exact values."""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass, field

import pytest

from app.settings.config_flags import FieldFlag, add_field_flags, field_flags, field_values
from engine.config import DOC


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Sample:
    required: Color = field(metadata={DOC: "a color"})
    count: int = field(default=3, metadata={DOC: "how many"})
    ratio: float = 0.5
    name: str | None = None
    on: bool = False
    tint: Color = Color.BLUE


@dataclass(frozen=True)
class Unflaggable:
    pairs: tuple[int, ...] = ()


NAMES = ("required", "count", "ratio", "name", "on", "tint")


def test_each_field_is_one_flag_with_its_type_default_and_help() -> None:
    assert field_flags(Sample, NAMES, {"required": "the_color"}) == [
        FieldFlag("required", "--the-color", Color, None, "a color"),
        FieldFlag("count", "--count", int, 3, "how many"),
        FieldFlag("ratio", "--ratio", float, 0.5, ""),
        FieldFlag("name", "--name", str, None, ""),
        FieldFlag("on", "--on", bool, False, ""),
        FieldFlag("tint", "--tint", Color, "blue", ""),
    ]
    with pytest.raises(TypeError, match=r"Unflaggable.pairs: no flag carries"):
        field_flags(Unflaggable, ("pairs",))


def test_parsed_flags_and_the_environment_come_back_as_field_values() -> None:
    parser = argparse.ArgumentParser()
    add_field_flags(parser, {"PDSERVE_RATIO": "0.25"}, Sample, NAMES)
    args = parser.parse_args(["--required", "red", "--count", "7", "--on"])
    assert field_values(args, Sample, NAMES) == {
        "required": Color.RED,
        "count": 7,
        "ratio": 0.25,
        "name": None,
        "on": True,
        "tint": Color.BLUE,
    }
    assert Sample(**field_values(args, Sample, NAMES)) == Sample(Color.RED, 7, 0.25, None, True)
    with pytest.raises(SystemExit):
        parser.parse_args(["--tint", "green"])  # not one of the Enum's values
