"""A checkpoint loaded for serving: weights on the device, the paged KV cache sized and allocated,
the runner that steps them, and the checks a request must pass against this model.

``LLMEngine`` holds one; it owns scheduling and request state, this owns the model and memory.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.block_hash import root_hash
from engine.config import DEFAULT_CPU_KV_CACHE_BYTES, AttentionBackend, EngineConfig
from engine.dtypes import torch_dtype
from engine.fingerprint import fingerprint_of
from engine.guide import GuideCompiler
from engine.intake import Intake
from engine.model_config import ModelConfig
from engine.tokenizer import Tokenizer
from native_engine.kernels.cpu import load_cpu_kernels
from native_engine.kv_cache import KVCache, KVCacheLayout
from native_engine.loader import build_model
from native_engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_GPU_MEMORY_FRACTION = 0.85


class LoadedModel:
    def __init__(self, config: EngineConfig, extra_block_bytes: int = 0) -> None:
        """``extra_block_bytes``: memory another cache spends per block of this one (a draft
        model's, holding as many blocks): the memory budget pays for both."""
        self.config = config
        self._extra_block_bytes = extra_block_bytes
        model_dir = Path(config.model)
        self.model_config = ModelConfig.from_dir(model_dir)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.guides = GuideCompiler.shared(
            model_dir, self.model_config.vocab_size, self.model_config.eos_token_ids
        )
        self.max_model_len = self._max_model_len()
        self.block_size = config.cache.block_size
        self.device = torch.device(
            config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        )
        kv_cache_dtype = config.cache.kv_cache_dtype
        self.fingerprint = fingerprint_of(model_dir, config.dtype, self.block_size, kv_cache_dtype)
        self.root_hash = root_hash(self.fingerprint)
        self.model = build_model(
            self.model_config,
            model_dir,
            torch_dtype(config.dtype),
            self.device,
            self.max_model_len,
        )
        mc = self.model_config
        self.kv_layout = KVCacheLayout(
            model_fingerprint=self.fingerprint,
            dtype=config.dtype,
            block_size=self.block_size,
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            kv_cache_dtype=kv_cache_dtype,
        )
        self.num_blocks = self._num_blocks()
        self.kv_cache = KVCache(self.kv_layout, self.num_blocks, self.device)
        self.attention_backend = self._attention_backend()
        self.runner = ModelRunner(
            self.model,
            self.kv_cache,
            self.device,
            self.attention_backend,
            eos_token_ids=mc.eos_token_ids,
        )
        logger.info(
            "engine ready: %s, %d KV blocks of %d tokens (%.1f MiB), max_model_len %d, "
            "attention %s",
            mc.architecture,
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.kv_layout.block_bytes / 2**20,
            self.max_model_len,
            self.attention_backend.value,
        )

    def _attention_backend(self) -> AttentionBackend:
        requested = self.config.attention_backend
        # The C++ kernel: any dtype with a full-precision cache; a quantized cache's codes are
        # decoded in fp32 there, which only a float32 model reads as the torch path does.
        quantized = self.config.cache.kv_cache_dtype.quantized
        native_ok = self.device.type == "cpu" and (self.config.dtype == "float32" or not quantized)
        if requested is None:
            if self.device.type == "cuda":
                return AttentionBackend.TRITON
            if native_ok and load_cpu_kernels():
                return AttentionBackend.CPU
            return AttentionBackend.TORCH
        if requested is AttentionBackend.CPU and not (native_ok and load_cpu_kernels()):
            raise ValueError(
                "attention_backend 'cpu' needs device cpu, a C++ compiler, and float32 with a "
                "quantized KV cache "
                f"(device {self.device.type}, dtype {self.config.dtype})"
            )
        return requested

    def _max_model_len(self) -> int:
        mc = self.model_config
        limit = min(mc.max_position_embeddings, mc.sliding_window or mc.max_position_embeddings)
        requested = self.config.max_model_len
        if requested is None:
            return limit
        if requested > limit:
            # Past the window the HF reference slides and we do not: refuse rather than differ.
            raise ValueError(
                f"max_model_len {requested} exceeds the model's limit {limit} "
                "(max_position_embeddings / sliding_window in config.json)"
            )
        return requested

    def _num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        budget = cache.kv_cache_bytes
        if budget is None:
            if self.device.type == "cuda":
                free_bytes, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free_bytes * _GPU_MEMORY_FRACTION)
            else:
                budget = DEFAULT_CPU_KV_CACHE_BYTES
        by_memory = budget // (self.kv_layout.block_bytes + self._extra_block_bytes)
        # More than every admitted sequence at full length can use is wasted memory.
        per_seq = -(-self.max_model_len // self.block_size)
        wanted = self.config.scheduler.max_num_seqs * per_seq
        num_blocks = min(by_memory, wanted)
        if num_blocks < per_seq:
            raise ValueError(
                f"KV cache budget of {budget} bytes holds {by_memory} blocks, fewer than one "
                f"max_model_len sequence needs ({per_seq}); raise kv_cache_bytes"
            )
        return int(num_blocks)

    @property
    def intake(self) -> Intake:
        """What a request must pass to enter an engine of this model."""
        mc = self.model_config
        return Intake(
            mc.vocab_size, mc.eos_token_ids, self.max_model_len, self.tokenizer, self.guides
        )
