"""The model layout's flags, the same on every command that starts or sizes a component
(``pdserve router|prefill|decode|up``, ``pdserve ray up``, ``pdserve profile``): each a field of
``ModelLayout`` (``engine/model_layout.py``), read back as one value. Part of ``app.settings``."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping

from app.settings.config_flags import add_field_flags
from app.settings.flags import add_flag
from engine.config import DOC
from engine.dtype_choice import AUTO, DTYPE_FLAG_CHOICES, resolve_dtype
from engine.model_layout import ModelLayout


def add_layout_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    add_field_flags(parser, env, ModelLayout, ("engine",))
    # The flag's default is ``auto``, the field's none: a layout holds a resolved dtype (it is
    # in the fingerprint), and ``auto`` is resolved here, from this machine (engine/dtype_choice).
    doc = {f.name: f for f in dataclasses.fields(ModelLayout)}["dtype"].metadata[DOC]
    add_flag(
        parser,
        "--dtype",
        env,
        default=AUTO,
        choices=DTYPE_FLAG_CHOICES,
        help=f"{doc}; auto: what this machine runs fastest (docs/engine.md) (default {AUTO})",
    )
    # Unset, the block size is the engine's (``block_size_for``): the flag's default is None.
    doc = {f.name: f for f in dataclasses.fields(ModelLayout)}["block_size"].metadata[DOC]
    add_flag(parser, "--block-size", env, type=int, default=None, help=doc)
    add_field_flags(parser, env, ModelLayout, ("kv_cache_dtype",))


def layout_of(args: argparse.Namespace) -> ModelLayout:
    """The flags' layout, ``--dtype auto`` resolved for ``--model`` on this machine. Raises
    ValueError naming a value that is none of its choices."""
    dtype = resolve_dtype(args.dtype, args.model).value
    return ModelLayout.parse(dtype, args.block_size, args.kv_cache_dtype, args.engine)
