"""Engine configuration: frozen dataclasses, validated on construction.

Only the CLI/settings layer reads argv or the environment; everything below takes these objects.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field

from engine.dtype_choice import AUTO, DTYPE_FLAG_CHOICES, resolve_dtype
from engine.dtypes import DTYPE_NAMES
from engine.kv_layout import KVCacheDtype

# The metadata key of a config field's description (a flag's help, where one sets it).
DOC = "doc"

# Output tokens one request may have waiting for its reader before the engine pauses it.
DEFAULT_MAX_BUFFERED_TOKENS = 256
# The KV cache budget on a CPU when none is given (every engine: a worker must not take the
# machine's memory by default).
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30


class AttentionBackend(enum.Enum):
    """How decode attention and KV stores run; prefill attention is torch's SDPA but on the CPU
    backend in bf16 with AMX (native_engine/kernels/prefill_attention.py)."""

    TORCH = "torch"  # portable: gather blocks, then scaled_dot_product_attention
    TRITON = "triton"  # CUDA kernels (also runs under TRITON_INTERPRET=1 on CPU, for tests)
    CPU = "cpu"  # native C++ kernel for CPU (fp32, bf16, fp16), compiled on first use


NATIVE_BLOCK_SIZE = 16


def check_block_size(block_size: int) -> None:
    """A KV block size is a power of two (the kernels' and the hashes' rule). Raises ValueError."""
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 1, got {block_size}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = NATIVE_BLOCK_SIZE  # ``block_size_for``: another engine's default
    # None: sized from kv_cache_bytes, capped at what max_num_seqs full-length sequences need.
    num_blocks: int | None = field(default=None, metadata={DOC: "KV blocks (default: memory)"})
    kv_cache_bytes: int | None = field(
        default=None, metadata={DOC: "the KV cache's memory (default: the engine's share)"}
    )
    enable_prefix_caching: bool = True
    host_cache_gib: float = field(
        default=0.0,
        metadata={
            DOC: "host-memory tier for evicted prefix blocks, GiB (0: off; needs prefix caching)"
        },
    )
    # How keys and values are stored (native_engine/kv_quant.py): the model's dtype, or int8 / fp8
    # codes with a float32 scale per token and kv head (about half the bytes of bf16).
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO

    def __post_init__(self) -> None:
        if not isinstance(self.kv_cache_dtype, KVCacheDtype):
            raise ValueError(f"kv_cache_dtype must be a KVCacheDtype, got {self.kv_cache_dtype!r}")
        check_block_size(self.block_size)
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if not 0 <= self.host_cache_gib < 1 << 20:
            raise ValueError(f"host_cache_gib must be >= 0, got {self.host_cache_gib}")
        if self.host_cache_gib and not self.enable_prefix_caching:
            raise ValueError("host_cache_gib needs prefix caching (the tier holds its blocks)")


class SchedulingPolicy(enum.Enum):
    """The order in which an engine serves the requests it holds (vLLM's
    ``--scheduling-policy``): ``fcfs``, by arrival; ``priority``, by ``SamplingParams.priority``
    (lower first), then arrival; under KV pressure the least urgent running request not yet
    scheduled in the step is preempted first."""

    FCFS = "fcfs"
    PRIORITY = "priority"


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field(default=128, metadata={DOC: "requests in one step, at most"})
    max_num_batched_tokens: int = field(
        default=2048,
        metadata={DOC: "a step's token budget: longer prompts are prefilled in chunks"},
    )
    # Paused requests (their reader stopped reading) keep their KV blocks up to these bounds:
    # past either, the oldest pause gives its blocks back (it recomputes them when its reader
    # catches up), and paused requests give theirs back first when blocks run short.
    max_paused_requests: int = field(
        default=32, metadata={DOC: "paused requests (a reader stopped) that keep their blocks"}
    )
    max_pause_s: float = field(
        default=60.0, metadata={DOC: "how long a paused request keeps its blocks, at most"}
    )
    scheduling_policy: SchedulingPolicy = field(
        default=SchedulingPolicy.FCFS,
        metadata={DOC: "the engine's order: fcfs (arrival) or priority (lower first; vLLM's)"},
    )
    # Aging bounds starvation: a request waiting behind a stream of more urgent ones gains one
    # priority level per this many seconds waited (native engine; vLLM has none).
    priority_aging_s: float = field(
        default=10.0,
        metadata={DOC: "priority policy: a waiting request gains one level per this many seconds"},
    )

    def __post_init__(self) -> None:
        if self.max_paused_requests < 0:
            raise ValueError(f"max_paused_requests must be >= 0, got {self.max_paused_requests}")
        if not self.priority_aging_s > 0:
            raise ValueError(f"priority_aging_s must be > 0, got {self.priority_aging_s}")
        if not self.max_pause_s > 0:
            raise ValueError(f"max_pause_s must be > 0, got {self.max_pause_s}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )


class SpecMethod(enum.Enum):
    """Where speculative tokens come from (verification is the same for both)."""

    NGRAM = "ngram"  # prompt lookup: the continuation of the last n tokens seen earlier
    DRAFT = "draft"  # a smaller checkpoint with the same vocabulary, run by this engine's code


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding. Output is token for token what plain decoding gives: a proposed
    token is kept only if it is the token the request's own sampler picks at its position."""

    method: SpecMethod = field(
        metadata={DOC: "propose tokens by n-gram lookup or with a draft model; output is unchanged"}
    )
    num_speculative_tokens: int = field(
        default=3, metadata={DOC: "k: tokens proposed per request and step"}
    )
    ngram_min: int = field(default=2, metadata={DOC: "shortest n-gram matched"})
    ngram_max: int = field(default=4, metadata={DOC: "longest n-gram matched (tried first)"})
    draft_model: str | None = field(default=None, metadata={DOC: "draft checkpoint directory"})
    # Adaptivity (always on): a request whose recent acceptance falls below this skips
    # speculation for a doubling number of steps, then tries again.
    min_acceptance: float = field(
        default=0.3,
        metadata={DOC: "a request whose recent acceptance is below this sits out (doubling) steps"},
    )
    # Verification costs k extra tokens per request; past a point the step is compute-bound
    # and it does not pay.
    max_batch_size: int = field(
        default=16, metadata={DOC: "steps decoding more requests than this do not speculate"}
    )

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if not 1 <= k <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {k}")
        if not 1 <= self.ngram_min <= self.ngram_max <= 16:
            raise ValueError(
                "spec_ngram_min/spec_ngram_max must satisfy 1 <= min <= max <= 16, got "
                f"{self.ngram_min}/{self.ngram_max}"
            )
        if (self.method is SpecMethod.DRAFT) != (self.draft_model is not None):
            raise ValueError(
                "spec_draft_model is required with speculative_method 'draft' and only with it"
            )
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError(f"spec_min_acceptance must be in [0, 1], got {self.min_acceptance}")
        if self.max_batch_size < 1:
            raise ValueError(f"spec_max_batch_size must be >= 1, got {self.max_batch_size}")


class EngineBackend(enum.Enum):
    """Which engine runs a worker's model (docs/engines.md). Both serve behind one contract
    (``engine/serving_engine.py``); their KV layouts differ, so one cluster uses one."""

    NATIVE = "native"  # this package: exact reference, the CPU default
    VLLM = "vllm"  # vLLM (``vllm_engine``): MoE, tensor parallelism, quantized weights, CUDA


ENGINE_BACKEND_NAMES = tuple(b.value for b in EngineBackend)
# The block size when none is given, per engine (the one rule: workers, the router and `pdserve
# up` resolve it alike, so their layouts agree): vLLM's CPU attention takes multiples of 32
# only ("No common block size for 16"), and 32 serves on its CUDA backends too.
DEFAULT_BLOCK_SIZES = {EngineBackend.NATIVE: NATIVE_BLOCK_SIZE, EngineBackend.VLLM: 32}


def block_size_for(given: int | None, backend: EngineBackend) -> int:
    """``--block-size`` as given, else the engine's default."""
    return DEFAULT_BLOCK_SIZES[backend] if given is None else given


_CORE_LIST = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*")


class VllmEngineCore(enum.Enum):
    """Where vLLM's engine core (its scheduler and the scheduler half of pdserve's connector)
    runs (docs/engines.md "Where vLLM's engine core runs")."""

    AUTO = "auto"  # WORKER for one rank on a CPU (measured faster there), else PROCESS
    WORKER = "worker"  # in the worker's process, stepped from a thread; one rank only
    PROCESS = "process"  # a process of its own (vLLM's), driven through vLLM's AsyncLLM


@dataclass(frozen=True)
class VllmOptions:
    """Options only the vLLM engine has, passed to vLLM under the same names."""

    tensor_parallel_size: int = field(
        default=1, metadata={DOC: "vLLM engine: GPUs one worker shards its model over"}
    )
    gpu_memory_utilization: float | None = field(
        default=None,
        metadata={
            DOC: "vLLM engine: fraction of GPU memory vLLM may take (vLLM's 0.9 when unset; "
            "on CPU the KV budget is the cache's kv_cache_bytes)"
        },
    )
    quantization: str | None = field(
        default=None,
        metadata={
            DOC: "vLLM engine: weight quantization method (vLLM's names; default: the checkpoint's)"
        },
    )
    enforce_eager: bool = field(
        default=False, metadata={DOC: "vLLM engine: no CUDA graphs or torch.compile"}
    )
    cpu_omp_threads_bind: str | None = field(
        default=None,
        metadata={
            DOC: "vLLM engine on CPU: each rank's cores, '|' between ranks ('0-1|2-3'; vLLM's "
            "VLLM_CPU_OMP_THREADS_BIND). Default: vLLM's, or under `pdserve up` each worker's "
            "share of the machine"
        },
    )
    engine_core: VllmEngineCore = field(
        default=VllmEngineCore.AUTO,
        metadata={
            DOC: "vLLM engine: where vLLM's engine core runs: worker (in the worker's process; "
            "one rank only), process (a process of its own, driven through vLLM's AsyncLLM), or "
            "auto (worker for one rank on a CPU, else process)"
        },
    )

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.engine_core is VllmEngineCore.WORKER and self.tensor_parallel_size > 1:
            raise ValueError(
                f"engine_core worker runs vLLM's one rank in the worker's process: "
                f"tensor_parallel_size {self.tensor_parallel_size} needs engine_core process"
            )
        bind = self.cpu_omp_threads_bind
        if bind is not None and bind not in ("auto", "nobind"):
            ranks = bind.split("|")
            if len(ranks) != self.tensor_parallel_size or not all(
                _CORE_LIST.fullmatch(r) for r in ranks
            ):
                raise ValueError(
                    f"cpu_omp_threads_bind {bind!r}: one core list per rank (tensor_parallel_size "
                    f"{self.tensor_parallel_size}), '|' between ranks, as '0-1|2,3'"
                )
        gmu = self.gpu_memory_utilization
        if gmu is not None and not 0.0 < gmu <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gmu}")

    def given(self) -> list[str]:
        """The options set away from their defaults, as flags."""
        default = VllmOptions()
        return [
            "--" + name.replace("_", "-")
            for name in self.__dataclass_fields__
            if getattr(self, name) != getattr(default, name)
        ]


@dataclass(frozen=True)
class EngineConfig:
    model: str
    # ``auto`` is resolved on construction, for this machine (engine/dtype_choice.py): a
    # config always holds the dtype it runs.
    dtype: str = field(
        default="auto", metadata={DOC: "float32, bfloat16, float16, or auto (docs/engine.md)"}
    )
    max_model_len: int | None = field(
        default=None, metadata={DOC: "longest request (default: the model's)"}
    )
    device: str | None = field(
        default=None, metadata={DOC: "cpu, cuda, cuda:1 (default: cuda if any)"}
    )
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    attention_backend: AttentionBackend | None = field(
        default=None,
        metadata={DOC: "default: triton on CUDA, cpu on CPU (torch if it cannot be built)"},
    )
    speculative: SpeculativeConfig | None = None  # None: no speculation
    # Workers sharing a machine each get their share (`pdserve up` divides them), else their
    # OpenMP threads spin against each other.
    num_threads: int | None = field(
        default=None,
        metadata={DOC: "torch threads of this worker (default: the CPUs it may run on)"},
    )
    backend: EngineBackend = EngineBackend.NATIVE
    vllm: VllmOptions = VllmOptions()
    # Fault injection (tests of poison prompts): the worker exits as a crash would.
    fault_exit_on_token: int | None = field(
        default=None,
        metadata={DOC: "fault injection (tests): exit with code 70 on a prompt holding this id"},
    )
    # Fault injection (tests of stuck steps): outside the GIL, as a hung device sync.
    fault_stall_at_step: int | None = field(
        default=None,
        metadata={DOC: "fault injection (tests): the engine's step N blocks for good"},
    )
    # Fault injection (tests of a dead engine's last words): an engine fault, not a request's
    # error; on the vLLM engine, its delivery of such a request's output raises.
    fault_raise_on_token: int | None = field(
        default=None,
        metadata={DOC: "fault injection (tests): a step holding a prompt with this id raises"},
    )
    # Routers stop routing to such a worker sooner, after their own stall_timeout_s
    # (engine/step_progress.py); past this, the orchestrator restarts it.
    liveness_stall_s: float = field(
        default=120.0,
        metadata={DOC: "an engine with work and no step completed this long fails /livez"},
    )

    def __post_init__(self) -> None:
        if self.dtype == AUTO:
            object.__setattr__(self, "dtype", resolve_dtype(AUTO, self.model).value)
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {DTYPE_FLAG_CHOICES}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if not self.liveness_stall_s > 0:
            raise ValueError(f"liveness_stall_s must be > 0, got {self.liveness_stall_s}")
        if self.fault_stall_at_step is not None and self.fault_stall_at_step < 1:
            raise ValueError(f"fault_stall_at_step must be >= 1, got {self.fault_stall_at_step}")
        refused = self.meaningless_options()
        if refused:
            raise ValueError(
                f"{', '.join(refused)} has no meaning for the {self.backend.value} engine "
                "(docs/engines.md)"
            )

    def meaningless_options(self) -> list[str]:
        """The options set (as flags) that the chosen engine does not have."""
        if self.backend is EngineBackend.NATIVE:
            return self.vllm.given()
        native_only = {
            "--device": self.device is not None,
            "--num-threads": self.num_threads is not None,  # vLLM binds its own threads
            "--attention-backend": self.attention_backend is not None,
            "--fault-stall-at-step": self.fault_stall_at_step is not None,
            "--speculative-method": self.speculative is not None,
            "--host-cache-gib": self.cache.host_cache_gib > 0,
            "--kv-cache-dtype": self.cache.kv_cache_dtype.quantized,
        }
        return [flag for flag, given in native_only.items() if given]
