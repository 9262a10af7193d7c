"""``--dtype auto``: the dtype a machine serves a checkpoint fastest in, decided once per
command from facts read without torch (the router resolves it too, and must agree).

The rule (``choose_dtype``, pure) is written here and tabled in docs/engine.md. Its test is
"fastest at equal exactness": a dtype is chosen only where the engine keeps its invariant in
it (a row's numerics do not depend on its batch, so disaggregated output is one engine's):

- a CUDA GPU: the checkpoint's own dtype (bfloat16 for a float32 checkpoint, as vLLM does);
- a CPU with AMX-BF16: bfloat16. A decode step reads every weight and bf16 halves the bytes;
  pdserve's AMX GEMM serves every M with the same sums, so every bf16 row is batch-invariant
  (issue 40: SmolLM2-135M decodes 3.3x faster in bf16 than in fp32 there);
- a CPU with AVX512-BF16 but no AMX, or AVX2 / FMA only: float32. The first's bf16 GEMMs above
  4 rows are oneDNN's, whose rows move with M; without bf16 hardware every engine measured
  runs bf16 about 3x slower than fp32 once batches pass a few rows (issue 40's AVX2 box);
- a model under ``MIN_BF16_PARAMS`` parameters: float32 on any CPU. Its weights sit in the
  CPU's caches, a step is bound by per-op overhead, not by bytes, and bf16 only costs precision.

Every component of one cluster must agree (the dtype is in the model fingerprint, and the router
refuses a worker whose fingerprint differs, naming both). ``pdserve up`` and ``pdserve ray up``
resolve it once and pass the result on; a cluster spanning machine kinds (Helm) names it.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

from engine.checkpoint import checkpoint_files, read_configs
from engine.dtypes import DTYPE_NAMES, ModelDtype

__all__ = [
    "AUTO",
    "DTYPE_FLAG_CHOICES",
    "MIN_BF16_PARAMS",
    "CheckpointFacts",
    "DtypeChoice",
    "MachineFacts",
    "checkpoint_facts",
    "choose_dtype",
    "machine_facts",
    "resolve_dtype",
]

log = logging.getLogger(__name__)

AUTO = "auto"
DTYPE_FLAG_CHOICES = (AUTO, *DTYPE_NAMES)
# 16 M parameters: 64 MB of fp32 weights, past the L2 of any CPU and most of an L3 slice.
MIN_BF16_PARAMS = 16_000_000
AMX_BF16 = "amx_bf16"


@dataclass(frozen=True)
class MachineFacts:
    cpu_flags: frozenset[str]  # /proc/cpuinfo's, lower case
    cuda: bool  # an NVIDIA driver with a GPU is present


@dataclass(frozen=True)
class CheckpointFacts:
    dtype: ModelDtype | None  # config.json's (torch_)dtype, None when not one of ours
    num_params: int | None  # from the safetensors headers; None when they cannot be read


@dataclass(frozen=True)
class DtypeChoice:
    dtype: ModelDtype
    reason: str  # one phrase, logged beside the choice


def choose_dtype(machine: MachineFacts, checkpoint: CheckpointFacts) -> DtypeChoice:
    """The module docstring's rule."""
    if machine.cuda:
        own = checkpoint.dtype
        if own is None or own is ModelDtype.FLOAT32:
            return DtypeChoice(ModelDtype.BFLOAT16, "CUDA GPU, a float32 or unnamed checkpoint")
        return DtypeChoice(own, "CUDA GPU: the checkpoint's dtype")
    if checkpoint.num_params is not None and checkpoint.num_params < MIN_BF16_PARAMS:
        return DtypeChoice(
            ModelDtype.FLOAT32,
            f"CPU, {checkpoint.num_params} parameters (< {MIN_BF16_PARAMS}: weights in cache)",
        )
    if AMX_BF16 in machine.cpu_flags:
        return DtypeChoice(ModelDtype.BFLOAT16, "CPU with amx_bf16: batch-invariant bf16 GEMMs")
    if "avx512_bf16" in machine.cpu_flags:
        return DtypeChoice(
            ModelDtype.FLOAT32, "CPU with avx512_bf16, no amx_bf16: bf16 rows move with the batch"
        )
    return DtypeChoice(ModelDtype.FLOAT32, "CPU without bf16 hardware (no amx_bf16)")


def machine_facts(cpuinfo: Path = Path("/proc/cpuinfo")) -> MachineFacts:
    """This machine's facts; a file that cannot be read counts as no flags."""
    flags: frozenset[str] = frozenset()
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                flags = frozenset(line.partition(":")[2].lower().split())
                break
    except OSError:
        pass
    gpus = Path("/proc/driver/nvidia/gpus")
    return MachineFacts(flags, gpus.is_dir() and any(gpus.iterdir()))


def checkpoint_facts(model: str | Path) -> CheckpointFacts:
    """A local checkpoint's dtype and size; an id no directory holds (a vLLM hub name) gives
    neither, and the rule treats it as a model past the size floor."""
    path = Path(model)
    if not (path / "config.json").is_file():
        return CheckpointFacts(None, None)
    try:
        raw, _ = read_configs(path)
    except ValueError:
        return CheckpointFacts(None, None)
    text = raw.get("text_config") or raw
    name = text.get("dtype") or text.get("torch_dtype") or raw.get("torch_dtype")
    return CheckpointFacts(ModelDtype(name) if name in DTYPE_NAMES else None, _num_params(path))


def _num_params(path: Path) -> int | None:
    """Elements over the safetensors headers (shapes only: no tensor is read)."""
    total = 0
    try:
        for file in checkpoint_files(path):
            with file.open("rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            for name, entry in header.items():
                if name != "__metadata__":
                    total += math.prod(int(dim) for dim in entry["shape"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return total


def resolve_dtype(requested: str, model: str | Path) -> ModelDtype:
    """``requested`` itself, or for ``auto`` this machine's choice for ``model`` (logged).
    Raises ValueError naming a value that is none of ``DTYPE_FLAG_CHOICES``."""
    if requested != AUTO:
        if requested not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {DTYPE_FLAG_CHOICES}, got {requested!r}")
        return ModelDtype(requested)
    choice = choose_dtype(machine_facts(), checkpoint_facts(model))
    log.info("dtype auto -> %s (%s; pid %d)", choice.dtype.value, choice.reason, os.getpid())
    return choice.dtype
