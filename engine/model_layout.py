"""The model layout: what, beside the checkpoint, decides the bytes a KV block holds (the model's
dtype, the block size, how keys and values are stored, the engine whose kernels compute them).

One value for a whole cluster: ``pdserve up``, ``pdserve ray up`` and Helm give every component
the same one (as flags, ``ModelLayout.flags``; Helm's ``pdserve.commonEnv``), the router and
every worker name it in their fingerprint (``engine/fingerprint.py``), and the router refuses a
worker whose fingerprint differs. Built once from the flags (``app/settings/layout_flags.py``),
then passed whole; an engine's own config holds its parts (``EngineConfig``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import DOC, EngineBackend, EngineConfig, block_size_for, check_block_size
from engine.dtypes import ModelDtype
from engine.kv_layout import KVCacheDtype


@dataclass(frozen=True)
class ModelLayout:
    dtype: ModelDtype = field(
        default=ModelDtype.FLOAT32, metadata={DOC: "the model's weights and activations"}
    )
    block_size: int = field(
        default=block_size_for(None, EngineBackend.NATIVE),
        metadata={DOC: "KV block size, in tokens (default: the engine's, 16 native, 32 vllm)"},
    )
    kv_cache_dtype: KVCacheDtype = field(
        default=KVCacheDtype.AUTO,
        metadata={DOC: "KV cache storage: the model dtype, or int8 / fp8_e4m3 codes with scales"},
    )
    engine: EngineBackend = field(
        default=EngineBackend.NATIVE,
        metadata={DOC: "the workers' engine: native (exact reference, CPU default) or vllm"},
    )

    def __post_init__(self) -> None:
        for name, kind in (
            ("dtype", ModelDtype),
            ("kv_cache_dtype", KVCacheDtype),
            ("engine", EngineBackend),
        ):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        check_block_size(self.block_size)

    @classmethod
    def parse(
        cls, dtype: str, block_size: int | None, kv_cache_dtype: str, engine: str
    ) -> ModelLayout:
        """From the flags' values; no block size is the engine's default. Raises ValueError
        naming a value that is none of its choices."""
        backend = EngineBackend(engine)
        return cls(
            ModelDtype(dtype),
            block_size_for(block_size, backend),
            KVCacheDtype.parse(kv_cache_dtype),
            backend,
        )

    @classmethod
    def of_engine(cls, config: EngineConfig) -> ModelLayout:
        """The layout an engine's config runs."""
        return cls(
            ModelDtype(config.dtype),
            config.cache.block_size,
            config.cache.kv_cache_dtype,
            config.backend,
        )

    def flags(self) -> tuple[str, ...]:
        """The layout as every component's command line takes it."""
        return (
            *("--dtype", self.dtype.value, "--block-size", str(self.block_size)),
            *("--kv-cache-dtype", self.kv_cache_dtype.value, "--engine", self.engine.value),
        )


DEFAULT_LAYOUT = ModelLayout()  # a config field's default, shared (frozen)
