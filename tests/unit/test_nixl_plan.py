"""The NIXL READ plan (pure): addresses of block slabs in two caches, runs merged only where
both sides are consecutive, exact values."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.kv_layout import KVCacheLayout
from kvtransfer.nixl_plan import Region, plan_read, runs

# 2 layers, block 4 tokens, 2 heads, head_dim 8, float32: 4 * 2 * 8 * 4 = 256 bytes per slab.
LAYOUT = KVCacheLayout("fp", "float32", 4, 2, 2, 8)


def test_runs_merge_only_where_both_sides_are_consecutive() -> None:
    assert runs([3, 4, 5, 9], [10, 11, 12, 13]) == [(3, 10, 3), (9, 13, 1)]
    assert runs([3, 4], [10, 12]) == [(3, 10, 1), (4, 12, 1)]
    assert runs([], []) == []
    with pytest.raises(ValueError, match="2 source blocks for 1"):
        runs([1, 2], [3])


def test_addresses_follow_the_cache_tensor() -> None:
    region = Region(base_address=1000, num_blocks=10, device_id=3)
    assert LAYOUT.slab_block_bytes == 256
    assert region.address(LAYOUT, 0, 0, 0) == 1000
    assert region.address(LAYOUT, 0, 1, 0) == 1000 + 10 * 256  # values after all key blocks
    assert region.address(LAYOUT, 1, 0, 2) == 1000 + (2 * 10 + 2) * 256
    with pytest.raises(ValueError, match="block 10 outside"):
        region.address(LAYOUT, 0, 0, 10)


def test_plan_pairs_rows_layer_major_keys_first() -> None:
    local, remote = Region(0, 8), Region(100_000, 4, device_id=1)
    local_rows, remote_rows = plan_read(LAYOUT, local, remote, [1, 2, 0], [5, 6, 3])
    assert remote_rows == [
        (100_000 + 1 * 256, 512, 1), (100_000 + 0 * 256, 256, 1),  # layer 0 keys
        (100_000 + 5 * 256, 512, 1), (100_000 + 4 * 256, 256, 1),  # layer 0 values
        (100_000 + 9 * 256, 512, 1), (100_000 + 8 * 256, 256, 1),  # layer 1 keys
        (100_000 + 13 * 256, 512, 1), (100_000 + 12 * 256, 256, 1),  # layer 1 values
    ]  # fmt: skip
    assert local_rows == [
        (5 * 256, 512, 0), (3 * 256, 256, 0),
        (13 * 256, 512, 0), (11 * 256, 256, 0),
        (21 * 256, 512, 0), (19 * 256, 256, 0),
        (29 * 256, 512, 0), (27 * 256, 256, 0),
    ]  # fmt: skip
    # A run reaching past either cache is refused, not read.
    with pytest.raises(ValueError, match="outside"):
        plan_read(LAYOUT, local, remote, [3, 4], [0, 1])


def test_without_nixl_a_worker_refuses_at_start_with_the_install_command(tmp_path: Path) -> None:
    # NIXL made unimportable; the model does not even exist: the backend is refused first.
    code = (
        "import sys; sys.modules['nixl_cu12'] = None\n"
        "from pdserve.app.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    command = [sys.executable, "-c", code, "prefill", "--kv-backend", "nixl"]
    command += ["--model", str(tmp_path / "no-model"), "--port", "0", "--kv-port", "0"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "pip install -c requirements/constraints-cpu.txt 'pdserve[nixl]'" in out.stderr
    assert "no-model" not in out.stderr and "Traceback" not in out.stderr
