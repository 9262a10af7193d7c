"""The NIXL READ plan (pure): addresses of block slabs in two caches, runs merged only where
both sides are consecutive, exact values."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from engine.kv_layout import KVCacheLayout
from kvtransfer.nixl_plan import Region, plan_read

# 2 layers, block 4 tokens, 2 heads, head_dim 8, float32: 4 * 2 * 8 * 4 = 256 bytes per slab.
LAYOUT = KVCacheLayout("fp", "float32", 4, 2, 2, 8)


def test_addresses_follow_the_cache_tensor() -> None:
    region = Region.contiguous(1000, LAYOUT, 10, device_id=3)
    assert LAYOUT.slab_block_bytes == 256
    assert region.address(LAYOUT, 0, 0, 0) == 1000
    assert region.address(LAYOUT, 0, 1, 0) == 1000 + 10 * 256  # values after all key blocks
    assert region.address(LAYOUT, 1, 0, 2) == 1000 + (2 * 10 + 2) * 256
    with pytest.raises(ValueError, match="block 10 outside"):
        region.address(LAYOUT, 0, 0, 10)


def test_plan_merges_rows_only_where_both_sides_are_consecutive() -> None:
    local, remote = Region.contiguous(0, LAYOUT, 8), Region.contiguous(100_000, LAYOUT, 4, 1)
    local_rows, remote_rows = plan_read(LAYOUT, local, remote, [1, 2, 0], [5, 6, 3])
    assert remote_rows == [
        (100_000 + 0 * 256, 256, 1), (100_000 + 1 * 256, 512, 1),  # layer 0 keys
        (100_000 + 4 * 256, 256, 1), (100_000 + 5 * 256, 512, 1),  # layer 0 values
        (100_000 + 8 * 256, 256, 1), (100_000 + 9 * 256, 512, 1),  # layer 1 keys
        (100_000 + 12 * 256, 256, 1), (100_000 + 13 * 256, 512, 1),  # layer 1 values
    ]  # fmt: skip
    assert local_rows == [
        (3 * 256, 256, 0), (5 * 256, 512, 0),
        (11 * 256, 256, 0), (13 * 256, 512, 0),
        (19 * 256, 256, 0), (21 * 256, 512, 0),
        (27 * 256, 256, 0), (29 * 256, 512, 0),
    ]  # fmt: skip
    # A run reaching past either cache is refused, not read.
    with pytest.raises(ValueError, match="outside"):
        plan_read(LAYOUT, local, remote, [3, 4], [0, 1])
    with pytest.raises(ValueError, match="2 source blocks for 1"):
        plan_read(LAYOUT, local, remote, [1, 2], [3])


def test_pages_whose_halves_alternate_merge_whole_pages() -> None:
    """vLLM's block-major pages: a block's keys then values in one page (stride: the page),
    so a block's two halves merge, and so do consecutive pages; a head range of such pages
    (a shard) is a run inside each page, its own stride the whole page's."""
    page = 2 * 256
    pages = Region((0, 256, 10_000, 10_256), (page,) * 4, 8)  # 2 layers of 8 pages
    local_rows, remote_rows = plan_read(LAYOUT, pages, pages, [2, 3], [6, 7])
    assert local_rows == [(6 * page, 2 * page, 0), (10_000 + 6 * page, 2 * page, 0)]
    assert remote_rows == [(2 * page, 2 * page, 0), (10_000 + 2 * page, 2 * page, 0)]
    # A one-head rank's whole pages (256 bytes) into head 0 of two-head pages (512 bytes).
    one_head = dataclasses.replace(LAYOUT, num_kv_heads=1)  # 128-byte slabs
    rank = Region((0, 128, 10_000, 10_128), (256,) * 4, 4)
    head_0 = Region((50_000, 50_128, 60_000, 60_128), (page,) * 4, 8)
    local_rows, remote_rows = plan_read(one_head, head_0, rank, [0], [1])
    assert remote_rows == [(0, 256, 0), (10_000, 256, 0)]
    assert local_rows == [(50_000 + page, 256, 0), (60_000 + page, 256, 0)]


def test_without_nixl_a_worker_refuses_at_start_with_the_install_command(tmp_path: Path) -> None:
    # NIXL made unimportable; the model does not even exist: the backend is refused first.
    code = (
        "import sys; sys.modules['nixl_cu12'] = None\n"
        "from app.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    command = [sys.executable, "-c", code, "prefill", "--kv-backend", "nixl"]
    command += ["--model", str(tmp_path / "no-model"), "--port", "0", "--kv-port", "0"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "pip install -c requirements/constraints-cpu.txt 'pdserve[nixl]'" in out.stderr
    assert "no-model" not in out.stderr and "Traceback" not in out.stderr
