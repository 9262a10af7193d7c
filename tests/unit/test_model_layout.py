"""The model layout: one value from the flags, the same flags back, refused by name."""

from __future__ import annotations

import argparse

import pytest

from app.settings import add_layout_flags, layout_of
from engine.config import CacheConfig, EngineBackend, EngineConfig
from engine.dtypes import ModelDtype
from engine.kv_layout import KVCacheDtype
from engine.model_layout import ModelLayout


def _parsed(*argv: str, env: dict[str, str] | None = None) -> ModelLayout:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="m")  # every command with the layout flags has one
    add_layout_flags(parser, env or {})
    return layout_of(parser.parse_args(list(argv)))


def test_the_flags_make_one_layout_and_the_layout_gives_the_same_flags_back() -> None:
    # Unset, --dtype is auto: this machine's choice (tests/unit/test_dtype_choice.py).
    assert _parsed("--dtype", "float32") == ModelLayout() == ModelLayout(ModelDtype.FLOAT32, 16)
    assert _parsed("--engine", "vllm").block_size == 32  # the engine's default
    layout = _parsed("--dtype", "bfloat16", "--block-size", "64", "--kv-cache-dtype", "int8")
    assert layout == ModelLayout(ModelDtype.BFLOAT16, 64, KVCacheDtype.INT8, EngineBackend.NATIVE)
    assert layout.flags() == (
        *("--dtype", "bfloat16", "--block-size", "64"),
        *("--kv-cache-dtype", "int8", "--engine", "native"),
    )
    assert _parsed(*layout.flags()) == layout
    assert _parsed(env={"PDSERVE_KV_CACHE_DTYPE": "fp8_e4m3"}).kv_cache_dtype.value == "fp8_e4m3"


def test_an_engine_config_holds_the_parts_of_its_layout() -> None:
    config = EngineConfig(
        "m", dtype="float16", cache=CacheConfig(block_size=8, kv_cache_dtype=KVCacheDtype.INT8)
    )
    assert ModelLayout.of_engine(config) == ModelLayout(
        ModelDtype.FLOAT16, 8, KVCacheDtype.INT8, EngineBackend.NATIVE
    )


def test_a_bad_layout_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="block_size must be a power of two >= 1, got 24"):
        ModelLayout(block_size=24)
    with pytest.raises(ValueError, match="dtype must be a ModelDtype, got 'float32'"):
        ModelLayout(dtype="float32")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_cache_dtype 'int4' is not one of"):
        ModelLayout.parse("float32", None, "int4", "native")
