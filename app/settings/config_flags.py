"""Flags derived from a config dataclass's fields: each field is written once, in its config
(name, type, default, and its ``doc`` metadata as the help), and its flag and its value read back
come from there. Part of ``app.settings``.

A field's flag is ``--`` and its name with dashes (``max_num_seqs`` -> ``--max-num-seqs``), or
the name ``flags`` gives it (a settings module's spelling, kept for flags older than this rule).
Its type is the annotation's: ``int``, ``float``, ``str``, an ``Enum`` (its values are the
choices), optional or not, or ``bool`` (a switch, off by default).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from app.settings.flags import add_flag, field_default
from engine.config import DOC


@dataclass(frozen=True)
class FieldFlag:
    """One field's flag."""

    field: str
    flag: str
    kind: type  # int, float, str, bool, or an Enum
    default: Any  # the config's (an Enum's value)
    help: str

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


def field_flags(
    config: type, names: Iterable[str], flags: Mapping[str, str] | None = None
) -> list[FieldFlag]:
    """The flags of ``config``'s fields ``names``, in that order. Raises TypeError for a field
    whose type no flag can carry."""
    hints = typing.get_type_hints(config)
    by_name = {f.name: f for f in dataclasses.fields(config)}
    out = []
    for name in names:
        spec = by_name[name]
        kind = _flag_type(hints[name], f"{config.__name__}.{name}")
        missing = dataclasses.MISSING
        required = spec.default is missing and spec.default_factory is missing
        # A required field's flag is optional: unset, the settings decide (a default elsewhere).
        default = None if required else field_default(config, name)
        flag = "--" + (flags or {}).get(name, name).replace("_", "-")
        out.append(FieldFlag(name, flag, kind, default, str(spec.metadata.get(DOC, ""))))
    return out


def add_field_flags(
    parser: argparse.ArgumentParser,
    env: Mapping[str, str] | None,
    config: type,
    names: Iterable[str],
    flags: Mapping[str, str] | None = None,
) -> None:
    for f in field_flags(config, names, flags):
        if f.kind is bool:
            add_flag(parser, f.flag, env, action="store_true", help=f.help)
            continue
        shown = f"{f.help} (default {f.default})" if f.default is not None else f.help
        if issubclass(f.kind, enum.Enum):
            choices = [member.value for member in f.kind]
            add_flag(parser, f.flag, env, default=f.default, choices=choices, help=shown)
        else:
            add_flag(parser, f.flag, env, type=f.kind, default=f.default, help=shown)


def field_values(
    args: argparse.Namespace,
    config: type,
    names: Iterable[str],
    flags: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The fields ``names`` of ``config`` as the parsed flags set them (an Enum's member)."""
    out = {}
    for f in field_flags(config, names, flags):
        value = getattr(args, f.dest)
        if value is not None and issubclass(f.kind, enum.Enum):
            value = f.kind(value)
        out[f.field] = value
    return out


def _flag_type(hint: Any, what: str) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType)
    kind = args[0] if optional and len(args) == 1 else hint
    if isinstance(kind, type) and (kind in (int, float, str, bool) or issubclass(kind, enum.Enum)):
        return kind
    raise TypeError(f"{what}: no flag carries {hint!r}")
