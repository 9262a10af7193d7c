"""The model fingerprint: names exactly which KV contents a block holds (torch-free, so the
router can compute it from the same checkpoint directory and refuse mismatched workers)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from engine.checkpoint import CheckpointInfo, checkpoint_files
from engine.config import EngineBackend
from engine.kv_layout import KVCacheDtype
from engine.model_config import ModelConfig
from engine.model_layout import ModelLayout

__all__ = [
    "checkpoint_files",
    "engine_fingerprint",
    "fingerprint_of",
    "model_fingerprint",
    "weights_identity",
]


def weights_identity(model_dir: Path) -> str:
    """A cheap identity of the weights: config, safetensors headers, sizes and sampled bytes.

    Hashing every byte of a 100+ GB checkpoint at start-up is too slow; headers (names, shapes,
    dtypes, offsets) plus 16 evenly spaced 64 KiB samples per file distinguish checkpoints that
    share an architecture, including two random initialisations of the same shapes.
    """
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    sample_bytes, num_samples = 64 * 1024, 16
    for path in checkpoint_files(model_dir):
        size = path.stat().st_size
        digest.update(path.name.encode() + size.to_bytes(8, "little"))
        with path.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            digest.update(f.read(header_len))
            for i in range(num_samples):
                f.seek(max(0, (size - sample_bytes) * i // max(num_samples - 1, 1)))
                digest.update(f.read(sample_bytes))
    return digest.hexdigest()[:32]


def model_fingerprint(
    config: ModelConfig,
    weights_id: str,
    dtype: str,
    block_size: int,
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO,
) -> str:
    """Names the exact KV layout and contents a block holds; seeds every block hash. A quantized
    cache adds its dtype, so its blocks never hash like full-precision ones (the full-precision
    fingerprint is unchanged from before quantization existed)."""
    kv = f":kv-{kv_cache_dtype.value}" if kv_cache_dtype.quantized else ""
    return f"{config.architecture}:{weights_id}:{dtype}:bs{block_size}{kv}"


def fingerprint_of(
    model_dir: str | Path,
    dtype: str,
    block_size: int,
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO,
) -> str:
    model_dir = Path(model_dir)
    return model_fingerprint(
        ModelConfig.from_dir(model_dir),
        weights_identity(model_dir),
        dtype,
        block_size,
        kv_cache_dtype,
    )


def engine_fingerprint(model_dir: str | Path, layout: ModelLayout) -> str:
    """The fingerprint of a worker of ``layout`` (the router computes it to refuse others).
    Another engine's blocks hold other numerics (its kernels), so its fingerprint names it and
    its block hashes never meet the native engine's; which vLLM release, attention backend
    and page layout is in the KV layout (``page_layout``), checked before any block moves."""
    dtype, block_size = layout.dtype.value, layout.block_size
    if layout.engine is EngineBackend.NATIVE:
        return fingerprint_of(model_dir, dtype, block_size, layout.kv_cache_dtype)
    architecture = CheckpointInfo.from_dir(model_dir).architecture
    identity = weights_identity(Path(model_dir))
    return f"{architecture}:{identity}:{dtype}:bs{block_size}:{layout.engine.value}"
