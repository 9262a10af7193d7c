"""The one chained block hasher.

The engine's prefix cache, the cluster prefix index and the router all call these functions, so
that a block hash computed anywhere names the same KV contents everywhere. A different hasher in
two places yields an index that silently never hits. Deliberately free of torch and of Python's
``hash()`` (salted per process): results are stable across processes, machines and versions.

hash(block i) = BLAKE2b-128(parent hash ‖ token ids of block i as little-endian uint32), where the
parent of block 0 is the *root hash*, derived from the model fingerprint. Two models, dtypes or
block sizes therefore never share a hash.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes
"""A 16-byte digest. ``.hex()`` is the form used in logs and in external indexes."""

_DIGEST_BYTES = 16
_ROOT_DOMAIN = b"pdserve.block_hash.v1"


def root_hash(model_fingerprint: str) -> BlockHash:
    """The parent of every sequence's first block, for one model fingerprint."""
    payload = _ROOT_DOMAIN + b"\x00" + model_fingerprint.encode()
    return hashlib.blake2b(payload, digest_size=_DIGEST_BYTES).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block given its parent's hash."""
    payload = struct.pack(f"<{len(token_ids)}I", *token_ids)
    return hashlib.blake2b(parent + payload, digest_size=_DIGEST_BYTES).digest()


def hash_blocks(
    root: BlockHash,
    token_ids: Sequence[int],
    block_size: int,
    start_block: int = 0,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``token_ids``, beginning at ``start_block``.

    ``parent`` is the hash of block ``start_block - 1`` (``root`` when ``start_block`` is 0), so
    callers can extend a sequence's hashes incrementally as tokens are appended. A trailing
    partial block is never hashed: its contents may still change.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if start_block > 0 and parent is None:
        raise ValueError("parent is required when start_block > 0")
    prev = root if start_block == 0 else parent
    assert prev is not None
    hashes: list[BlockHash] = []
    num_full_blocks = len(token_ids) // block_size
    for i in range(start_block, num_full_blocks):
        prev = hash_block(prev, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(prev)
    return hashes
