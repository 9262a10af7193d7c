"""Native CPU kernels, compiled on first use: paged decode attention (below), the small-M bf16
GEMM (``small_gemm.py``) and the bf16 step's fused elementwise ops (``fused_ops.py``).

Paged decode attention: the torch path gathers every decode sequence's K/V blocks into a
padded copy and then runs attention over the copy: the cache is read twice and written once.
This kernel walks the block table and reads each K/V row in place, once, prefetching rows
ahead (blocks lie wherever the allocator put them, so without it every row waits on DRAM
latency), and cuts long contexts into spans across threads (flash-decoding). All are built
with ``torch.utils.cpp_extension`` into torch's extension cache (~20 s, once per machine).
If the build fails the engine logs why and uses the torch path: never a silent slow path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [
    _CSRC / "paged_decode_attention_cpu.cpp",
    _CSRC / "decode_span.cpp",
    _CSRC / "decode_span_amx.cpp",
    _CSRC / "small_gemm.cpp",
    _CSRC / "small_gemm_avx.cpp",
    _CSRC / "small_gemm_amx.cpp",
    _CSRC / "fused_ops.cpp",
    _CSRC / "fused_ops_f32.cpp",
    _CSRC / "argmax_rows.cpp",
    _CSRC / "decode_layer.cpp",
    _CSRC / "prefill_attention_amx.cpp",
    _CSRC / "exponential_race.cpp",
]
# A build takes ~20 s; a lock older than this was left by a killed process and would make
# every later build wait on it forever.
_STALE_LOCK_S = 600


def _cpu_tag() -> str:
    """Names this CPU's instruction sets: the kernel is built for them (``-march=native``), so
    a build cache shared by other machines (a network home) never hands this one theirs."""
    try:
        flags = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.blake2b(flags.encode(), digest_size=4).hexdigest()


def _csrc_digest() -> str:
    digest = hashlib.blake2b(digest_size=6)
    for path in sorted(_CSRC.iterdir()):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _build_directory() -> Path:
    from torch.utils import cpp_extension

    root = Path(cpp_extension.get_default_build_root())
    path = root / f"pdserve_cpu_kernels-torch{torch.__version__}-{_cpu_tag()}"
    path.mkdir(parents=True, exist_ok=True)
    lock = path / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
        logger.warning("removing stale build lock %s", lock)
        lock.unlink(missing_ok=True)
    return path


@functools.cache
def load_cpu_kernels() -> bool:
    """Build/load the op once per process; False (with a logged reason) when unavailable."""
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(
            name="pdserve_cpu_kernels",
            sources=[str(path) for path in _SOURCES],
            # -march=native: AVX-512 where the CPU has it (decode_span.cpp is written for it);
            # the build directory is per CPU (_cpu_tag). torch rebuilds when a source or a
            # flag changes, so the flags carry a digest of the header too.
            extra_cflags=[
                "-O3",
                "-ffast-math",
                "-fopenmp",
                "-march=native",
                f"-DPDSERVE_CSRC_DIGEST={_csrc_digest()}",
            ],
            build_directory=str(_build_directory()),
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # a compiler problem must not take the engine down
        logger.warning("native CPU attention kernel unavailable (%s); using the torch path", exc)
        return False
    return True


def cpu_ops() -> Any:
    """``torch.ops.pdserve_cpu``, built first; RuntimeError where it could not be built (a
    caller that has a torch path checks ``load_cpu_kernels`` instead)."""
    if not load_cpu_kernels():
        raise RuntimeError("the native CPU kernels did not build here (the log says why)")
    return torch.ops.pdserve_cpu


def paged_decode_attention_cpu(
    query: torch.Tensor,  # [num_seqs, num_q_heads, head_dim] fp32, bf16 or fp16
    # [num_blocks, block_size, num_kv_heads, head_dim]: the query's dtype, or uint8 codes (fp32
    # query only)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    k_scales: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] f32: codes only
    v_scales: torch.Tensor | None = None,
    codebook: torch.Tensor | None = None,  # [256] f32: the value of each code
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    """Full precision, or (with scales and codebook) a quantized cache decoded as it is read:
    row = codebook[code] * scale, exactly as ``native_engine.kv_quant.dequantize``."""
    ops = torch.ops.pdserve_cpu
    if codebook is None:
        out: torch.Tensor = ops.paged_decode_attention(
            query, k_cache, v_cache, block_tables, context_lens, scale
        )
        return out
    assert k_scales is not None and v_scales is not None
    quantized: torch.Tensor = ops.paged_decode_attention_quantized(
        query, k_cache, v_cache, k_scales, v_scales, codebook, block_tables, context_lens, scale
    )
    return quantized
