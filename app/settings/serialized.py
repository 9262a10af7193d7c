"""A component's frozen config as JSON and back: how ``pdserve up`` hands each child process
its whole typed config (on stdin, so secrets stay off argv and disk) instead of an argv to
re-parse or edit.

The encoding follows the dataclasses' own field types (bool, int, float, str, Enums by value,
tuples, ``X | None``, nested config dataclasses); decoding rebuilds the dataclasses, so each
one validates itself on construction again. Unknown or missing fields are named errors.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from typing import Any

from decode_service.config import DecodeConfig
from kvstore_service.config import KVStoreConfig
from pdserve.common.role import Role
from prefill_service.config import PrefillConfig
from router.config import RouterConfig

ServiceConfig = RouterConfig | PrefillConfig | DecodeConfig | KVStoreConfig

CONFIG_TYPES: dict[Role, type[ServiceConfig]] = {
    Role.ROUTER: RouterConfig,
    Role.PREFILL: PrefillConfig,
    Role.DECODE: DecodeConfig,
    Role.KVSTORE: KVStoreConfig,
}


def role_of(config: ServiceConfig) -> Role:
    return next(role for role, cls in CONFIG_TYPES.items() if isinstance(config, cls))


def to_json(config: ServiceConfig) -> str:
    """``{"role": ..., "config": {...}}``: the role and every constructor field."""
    return json.dumps({"role": role_of(config).value, "config": _encode(config)})


def from_json(text: str) -> ServiceConfig:
    """The config ``to_json`` wrote, validated again. Raises ValueError naming the field."""
    try:
        raw = json.loads(text)
        role = Role(raw["role"])
        body = raw["config"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"not a serialized pdserve config: {exc}") from None
    config = _decode(CONFIG_TYPES[role], body, "config")
    assert isinstance(config, CONFIG_TYPES[role])
    return config


def _encode(value: object) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init
        }
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"cannot serialize a config value of type {type(value).__name__}")


def _decode(kind: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(kind) if a is not type(None)]
        if value is None and len(options) < len(typing.get_args(kind)):
            return None
        if len(options) != 1:
            raise TypeError(f"{where}: unsupported union {kind}")
        return _decode(options[0], value, where)
    if origin is tuple:
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        (item, _) = typing.get_args(kind)  # tuple[X, ...]
        return tuple(_decode(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return _decode_dataclass(kind, value, where)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        try:
            return kind(value)
        except ValueError:
            raise ValueError(f"{where}: {value!r} is not a {kind.__name__}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind in (bool, int, str, float) and type(value) is kind:
        return value
    raise ValueError(f"{where}: expected {getattr(kind, '__name__', kind)}, got {value!r}")


def _decode_dataclass(kind: type, value: Any, where: str) -> Any:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected an object, got {value!r}")
    hints = typing.get_type_hints(kind)
    names = {f.name for f in dataclasses.fields(kind) if f.init}
    unknown = sorted(set(value) - names)
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r} of {kind.__name__}")
    missing = sorted(names - set(value))
    if missing:
        raise ValueError(f"{where}: missing field {missing[0]!r} of {kind.__name__}")
    return kind(**{n: _decode(hints[n], value[n], f"{where}.{n}") for n in names})
