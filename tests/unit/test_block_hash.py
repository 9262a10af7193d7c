"""engine/block_hash.py: the chained BLAKE2b-128 block hasher, checked against an independent
reimplementation of the documented scheme and against pinned digests."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from engine.block_hash import hash_block, hash_blocks, root_hash

REPO_ROOT = Path(__file__).resolve().parents[2]
FINGERPRINT = "llama-test/float32/bs4"
# Pinned digests (also equal to the independent reference below): they must never change, since
# external prefix indexes and routers store them.
GOLDEN_ROOT = "2fdc358c02c3d4599d4c8dbb2ffbf975"
GOLDEN_BLOCKS_0_TO_9_BS4 = [
    "ea7206800c139275f9e1fe9d67bf80b7",
    "3854c48ecfc0a4261d4883553bce573f",
]


def ref_root(fingerprint: str) -> bytes:
    payload = b"pdserve.block_hash.v1\x00" + fingerprint.encode("utf-8")
    return hashlib.blake2b(payload, digest_size=16).digest()


def ref_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    payload = b"".join(t.to_bytes(4, "little", signed=False) for t in token_ids)
    return hashlib.blake2b(parent + payload, digest_size=16).digest()


def ref_chain(fingerprint: str, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    prev = ref_root(fingerprint)
    out: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        prev = ref_block(prev, token_ids[i * block_size : (i + 1) * block_size])
        out.append(prev)
    return out


def test_root_hash_is_16_bytes_and_deterministic() -> None:
    a = root_hash(FINGERPRINT)
    b = root_hash(FINGERPRINT)
    assert isinstance(a, bytes)
    assert len(a) == 16
    assert a == b


def test_root_hash_matches_independent_blake2b() -> None:
    assert root_hash(FINGERPRINT) == ref_root(FINGERPRINT)
    assert root_hash("") == ref_root("")
    assert root_hash("modèle/ü") == ref_root("modèle/ü")


def test_pinned_digests() -> None:
    root = root_hash(FINGERPRINT)
    assert root.hex() == GOLDEN_ROOT
    assert [h.hex() for h in hash_blocks(root, list(range(10)), 4)] == GOLDEN_BLOCKS_0_TO_9_BS4


def test_hash_block_matches_independent_blake2b() -> None:
    parent = ref_root(FINGERPRINT)
    tokens = [0, 1, 255, 256, 65_535, 65_536, 2**31, 2**32 - 1]
    digest = hash_block(parent, tokens)
    assert len(digest) == 16
    assert digest == ref_block(parent, tokens)
    # Little-endian uint32 layout exactly: 1 -> 01 00 00 00.
    expected = hashlib.blake2b(parent + b"\x01\x00\x00\x00", digest_size=16).digest()
    assert hash_block(parent, [1]) == expected


def test_hash_blocks_matches_independent_chain() -> None:
    tokens = [(i * 7919) % 50_000 for i in range(37)]
    for block_size in (1, 2, 4, 16):
        got = hash_blocks(root_hash(FINGERPRINT), tokens, block_size)
        assert got == ref_chain(FINGERPRINT, tokens, block_size)
        assert len(got) == 37 // block_size


def test_hash_blocks_is_deterministic() -> None:
    root = root_hash(FINGERPRINT)
    tokens = list(range(100, 132))
    assert hash_blocks(root, tokens, 8) == hash_blocks(root, list(tokens), 8)
    assert hash_blocks(root, tuple(tokens), 8) == hash_blocks(root, tokens, 8)


def test_changing_block_zero_changes_every_later_hash() -> None:
    root = root_hash(FINGERPRINT)
    tokens = list(range(12))
    base = hash_blocks(root, tokens, 4)
    changed = list(tokens)
    changed[2] = 999
    other = hash_blocks(root, changed, 4)
    assert len(base) == len(other) == 3
    # Blocks 1 and 2 have identical token ids, but their parents differ.
    assert all(a != b for a, b in zip(base, other, strict=True))


def test_changing_block_one_keeps_block_zero() -> None:
    root = root_hash(FINGERPRINT)
    tokens = list(range(12))
    base = hash_blocks(root, tokens, 4)
    changed = list(tokens)
    changed[5] = 999
    other = hash_blocks(root, changed, 4)
    assert other[0] == base[0]
    assert other[1] != base[1]
    assert other[2] != base[2]


def test_same_block_contents_at_different_positions_hash_differently() -> None:
    root = root_hash(FINGERPRINT)
    hashes = hash_blocks(root, [5, 5, 5, 5] * 3, 4)
    assert len(set(hashes)) == 3


def test_different_fingerprint_gives_different_hashes() -> None:
    tokens = list(range(16))
    a = hash_blocks(root_hash("model-a"), tokens, 4)
    b = hash_blocks(root_hash("model-b"), tokens, 4)
    assert root_hash("model-a") != root_hash("model-b")
    assert len(a) == len(b) == 4
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_partial_trailing_block_is_not_hashed() -> None:
    root = root_hash(FINGERPRINT)
    tokens = list(range(11))
    full = hash_blocks(root, tokens[:8], 4)
    assert len(full) == 2
    assert hash_blocks(root, tokens[:9], 4) == full
    assert hash_blocks(root, tokens[:11], 4) == full
    assert hash_blocks(root, tokens[:7], 4) == full[:1]
    assert hash_blocks(root, tokens[:3], 4) == []
    assert hash_blocks(root, [], 4) == []


@pytest.mark.parametrize("start_block", [0, 1, 2, 3, 4])
def test_incremental_from_start_block_equals_one_shot(start_block: int) -> None:
    root = root_hash(FINGERPRINT)
    tokens = list(range(1000, 1018))  # 4 full blocks of 4 and 2 trailing tokens
    full = hash_blocks(root, tokens, 4)
    assert len(full) == 4
    parent = full[start_block - 1] if start_block > 0 else None
    assert hash_blocks(root, tokens, 4, start_block, parent) == full[start_block:]


def test_start_block_zero_ignores_parent() -> None:
    root = root_hash(FINGERPRINT)
    tokens = list(range(8))
    assert hash_blocks(root, tokens, 4, 0, b"\xff" * 16) == hash_blocks(root, tokens, 4)


def test_token_by_token_extension_equals_one_shot() -> None:
    root = root_hash(FINGERPRINT)
    tokens = [(i * 31) % 997 for i in range(29)]
    hashes: list[bytes] = []
    for n in range(1, len(tokens) + 1):
        parent = hashes[-1] if hashes else None
        hashes.extend(hash_blocks(root, tokens[:n], 4, len(hashes), parent))
    assert hashes == hash_blocks(root, tokens, 4)
    assert len(hashes) == 7


def test_hash_is_stable_across_processes() -> None:
    """A fresh interpreter with a different str-hash seed computes the same digests, so Python's
    salted ``hash()`` plays no part. The module is loaded by path to keep the child fast."""
    tokens = list(range(10))
    expected = [root_hash(FINGERPRINT).hex()] + [
        h.hex() for h in hash_blocks(root_hash(FINGERPRINT), tokens, 4)
    ]
    code = (
        "import importlib.util, json, sys\n"
        "spec = importlib.util.spec_from_file_location('bh', sys.argv[1])\n"
        "m = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(m)\n"
        "r = m.root_hash(sys.argv[2])\n"
        "hs = m.hash_blocks(r, list(range(10)), 4)\n"
        "print(json.dumps([r.hex()] + [h.hex() for h in hs]))\n"
    )
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        proc = subprocess.run(
            [sys.executable, "-c", code, str(REPO_ROOT / "engine" / "block_hash.py"), FINGERPRINT],
            capture_output=True,
            text=True,
            check=True,
            env=env,
            timeout=60,
        )
        assert json.loads(proc.stdout) == expected
    assert expected[0] == GOLDEN_ROOT
    assert expected[1:] == GOLDEN_BLOCKS_0_TO_9_BS4


@pytest.mark.parametrize("block_size", [0, -1])
def test_block_size_below_one_raises(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        hash_blocks(root_hash(FINGERPRINT), list(range(8)), block_size)


def test_missing_parent_raises() -> None:
    with pytest.raises(ValueError, match="parent"):
        hash_blocks(root_hash(FINGERPRINT), list(range(8)), 4, start_block=1)
