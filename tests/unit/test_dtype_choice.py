"""``--dtype auto`` (engine/dtype_choice.py): the rule's exact choices, the facts read from a real
checkpoint and a cpuinfo file, and the flag and config that resolve it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from app.settings.layout_flags import add_layout_flags, layout_of
from engine.config import EngineConfig
from engine.dtype_choice import (
    MIN_BF16_PARAMS,
    CheckpointFacts,
    MachineFacts,
    checkpoint_facts,
    choose_dtype,
    machine_facts,
    resolve_dtype,
)
from engine.dtypes import ModelDtype

AMX = frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
AVX512_BF16 = frozenset({"avx2", "fma", "avx512f", "avx512_bf16"})
AVX2 = frozenset({"avx2", "fma"})
BIG = 135_000_000


@pytest.mark.parametrize(
    ("flags", "cuda", "own", "params", "want"),
    [
        (AMX, False, ModelDtype.BFLOAT16, BIG, ModelDtype.BFLOAT16),
        (AVX512_BF16, False, ModelDtype.BFLOAT16, BIG, ModelDtype.FLOAT32),
        (AVX2, False, ModelDtype.BFLOAT16, BIG, ModelDtype.FLOAT32),
        (AMX, False, ModelDtype.BFLOAT16, MIN_BF16_PARAMS - 1, ModelDtype.FLOAT32),
        (AMX, False, ModelDtype.BFLOAT16, MIN_BF16_PARAMS, ModelDtype.BFLOAT16),
        (AMX, False, None, None, ModelDtype.BFLOAT16),  # a hub id: past the floor
        (AVX2, True, ModelDtype.FLOAT16, BIG, ModelDtype.FLOAT16),
        (AVX2, True, ModelDtype.BFLOAT16, 1000, ModelDtype.BFLOAT16),
        (AVX2, True, ModelDtype.FLOAT32, BIG, ModelDtype.BFLOAT16),
        (AVX2, True, None, None, ModelDtype.BFLOAT16),
    ],
)
def test_the_rule(
    flags: frozenset[str], cuda: bool, own: ModelDtype | None, params: int | None, want: ModelDtype
) -> None:
    choice = choose_dtype(MachineFacts(flags, cuda), CheckpointFacts(own, params))
    assert choice.dtype is want
    assert choice.reason


def test_machine_facts_read_the_flags_line(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu AVX2 avx512_bf16 amx_bf16\nbugs\t: x\n")
    assert machine_facts(cpuinfo).cpu_flags == {"fpu", "avx2", "avx512_bf16", "amx_bf16"}
    assert machine_facts(tmp_path / "absent").cpu_flags == frozenset()


def test_checkpoint_facts_count_a_real_checkpoints_parameters(llama_dir: Path) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(llama_dir / "model.safetensors"))
    facts = checkpoint_facts(llama_dir)
    assert facts.num_params == sum(t.numel() for t in tensors.values())
    assert facts.num_params < MIN_BF16_PARAMS  # the test models stay float32 under auto
    assert facts.dtype is ModelDtype.of(next(iter(tensors.values())).dtype)
    assert checkpoint_facts("org/not-a-directory") == CheckpointFacts(None, None)


def test_auto_resolves_in_the_flags_and_the_config(llama_dir: Path) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    add_layout_flags(parser, {})
    args = parser.parse_args(["--model", str(llama_dir)])
    assert args.dtype == "auto"
    assert layout_of(args).dtype is ModelDtype.FLOAT32  # a small model: float32 anywhere
    explicit = parser.parse_args(["--model", str(llama_dir), "--dtype", "bfloat16"])
    assert layout_of(explicit).dtype is ModelDtype.BFLOAT16
    assert EngineConfig(str(llama_dir)).dtype == "float32"
    assert EngineConfig(str(llama_dir), dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(str(llama_dir), dtype="fp8")
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("fp8", llama_dir)
