"""The flags of ``pdserve prefill`` and ``pdserve decode`` (engine, KV, leases) and their
configs. Part of ``app.settings``."""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Mapping

from app.settings.flags import (
    add_engine_flag,
    add_flag,
    add_kv_cache_dtype_flag,
    add_server_flags,
    csv,
    field_default,
    redis_config,
    server_config,
)
from decode_service.config import DecodeConfig
from engine.config import (
    AttentionBackend,
    CacheConfig,
    EngineBackend,
    EngineConfig,
    SchedulerConfig,
    SpecMethod,
    SpeculativeConfig,
    VllmEngineCore,
    VllmOptions,
    block_size_for,
)
from engine.dtypes import DTYPE_NAMES
from engine.kv_layout import KVCacheDtype
from kvtransfer import NETWORK_BACKENDS
from prefill_service.config import DEFAULT_LEASE_S, PrefillConfig

# Every SchedulerConfig field is a flag of the same name, of this type.
SCHEDULER_FLAGS: dict[str, type] = {
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "max_paused_requests": int,
    "max_pause_s": float,
}


def add_engine_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    add_flag(parser, "--model", env, required=True, help="HF checkpoint directory")
    add_engine_flag(parser, env)
    add_vllm_flags(parser, env)
    add_flag(
        parser, "--dtype", env, default=field_default(EngineConfig, "dtype"), choices=DTYPE_NAMES
    )
    add_flag(parser, "--max-model-len", env, type=int, default=None)
    add_flag(
        parser,
        "--block-size",
        env,
        type=int,
        default=None,
        help="KV block size (default: the engine's, 16 native, 32 vllm)",
    )
    add_flag(
        parser, "--num-blocks", env, type=int, default=None, help="KV blocks (default: memory)"
    )
    add_flag(parser, "--kv-cache-bytes", env, type=int, default=None)
    add_flag(parser, "--no-prefix-caching", env, action="store_true")
    add_flag(
        parser,
        "--host-cache-gib",
        env,
        type=float,
        default=field_default(CacheConfig, "host_cache_gib"),
        help="host-memory tier for evicted prefix blocks, GiB (0: off)",
    )
    add_kv_cache_dtype_flag(
        parser, env, "KV cache storage: the model dtype, or int8 / fp8_e4m3 codes with scales"
    )
    add_flag(
        parser,
        "--num-threads",
        env,
        type=int,
        default=None,
        help="torch threads of this worker (default: the CPUs it may run on)",
    )
    for name, kind in SCHEDULER_FLAGS.items():
        flag = "--" + name.replace("_", "-")
        add_flag(parser, flag, env, type=kind, default=field_default(SchedulerConfig, name))
    add_flag(parser, "--device", env, default=None, help="cpu, cuda, cuda:1 (default: cuda if any)")
    add_flag(
        parser,
        "--attention-backend",
        env,
        default=None,
        choices=[b.value for b in AttentionBackend],
    )
    add_flag(
        parser,
        "--kv-backend",
        env,
        default=field_default(PrefillConfig, "kv_backend"),
        choices=NETWORK_BACKENDS,
        help="KV transfer",
    )
    add_flag(
        parser,
        "--ray-address",
        env,
        default=field_default(PrefillConfig, "ray_address"),
        help="Ray cluster for --kv-backend ray: auto or the GCS HOST:PORT (in a Ray actor: unused)",
    )
    add_flag(parser, "--worker-id", env, default=None, help="registry id (default: <role>-<8 hex>)")
    add_flag(
        parser,
        "--fault-exit-on-token",
        env,
        type=int,
        default=field_default(EngineConfig, "fault_exit_on_token"),
        help="fault injection (tests): exit with code 70 on a prompt holding this token id",
    )
    add_flag(
        parser,
        "--fault-stall-at-step",
        env,
        type=int,
        default=field_default(EngineConfig, "fault_stall_at_step"),
        help="fault injection (tests): the engine's step N blocks for good (a hung device sync)",
    )
    add_flag(
        parser,
        "--fault-raise-on-token",
        env,
        type=int,
        default=field_default(EngineConfig, "fault_raise_on_token"),
        help="fault injection (tests): a step holding a prompt with this token id raises",
    )
    add_flag(
        parser,
        "--liveness-stall-s",
        env,
        type=float,
        default=field_default(EngineConfig, "liveness_stall_s"),
        help="an engine with work and no step completed this long fails /livez",
    )
    add_flag(
        parser,
        "--ucx-tls",
        env,
        default=None,
        help="--kv-backend nixl: UCX_TLS for this worker (default: UCX's own choice)",
    )
    add_flag(
        parser,
        "--kv-verify",
        env,
        default="on",
        choices=("on", "off"),
        help="--kv-backend nixl: prefill records a digest of each handle's blocks, decode checks"
        " what it read against it",
    )


def add_vllm_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    """The options only the vLLM engine has, under vLLM's own names (refused by name with the
    native engine)."""
    default = VllmOptions()
    add_flag(
        parser,
        "--tensor-parallel-size",
        env,
        type=int,
        default=default.tensor_parallel_size,
        help="--engine vllm: GPUs one worker shards its model over",
    )
    add_flag(
        parser,
        "--gpu-memory-utilization",
        env,
        type=float,
        default=default.gpu_memory_utilization,
        help="--engine vllm: fraction of GPU memory vLLM may take (on CPU: --kv-cache-bytes)",
    )
    add_flag(
        parser,
        "--quantization",
        env,
        default=default.quantization,
        help="--engine vllm: weight quantization method (vLLM's names; default: the checkpoint's)",
    )
    add_flag(
        parser,
        "--enforce-eager",
        env,
        action="store_true",
        help="--engine vllm: no CUDA graphs or torch.compile",
    )
    add_flag(
        parser,
        "--cpu-omp-threads-bind",
        env,
        default=default.cpu_omp_threads_bind,
        help="--engine vllm on CPU: each rank's cores, '|' between ranks ('0-1|2-3'; vLLM's "
        "VLLM_CPU_OMP_THREADS_BIND). Default: vLLM's, or under `pdserve up` each worker's "
        "share of the machine",
    )
    add_flag(
        parser,
        "--engine-core",
        env,
        choices=[mode.value for mode in VllmEngineCore],
        default=default.engine_core.value,
        help="--engine vllm: where vLLM's engine core runs: worker (in the worker's process; "
        "one rank only), process (a process of its own, driven through vLLM's AsyncLLM), or "
        "auto (worker for one rank on a CPU, else process)",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    backend = args.attention_backend
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        device=args.device,
        cache=CacheConfig(
            block_size=block_size_for(args.block_size, EngineBackend(args.engine)),
            num_blocks=args.num_blocks,
            kv_cache_bytes=args.kv_cache_bytes,
            enable_prefix_caching=not args.no_prefix_caching,
            host_cache_gib=args.host_cache_gib,
            kv_cache_dtype=KVCacheDtype.parse(args.kv_cache_dtype),
        ),
        scheduler=SchedulerConfig(**{name: getattr(args, name) for name in SCHEDULER_FLAGS}),
        attention_backend=AttentionBackend(backend) if backend else None,
        num_threads=args.num_threads,
        backend=EngineBackend(args.engine),
        fault_exit_on_token=args.fault_exit_on_token,
        fault_stall_at_step=args.fault_stall_at_step,
        fault_raise_on_token=args.fault_raise_on_token,
        liveness_stall_s=args.liveness_stall_s,
        vllm=vllm_options(args),
    )


def vllm_options(args: argparse.Namespace) -> VllmOptions:
    """The flags ``add_vllm_flags`` added, as their config."""
    return VllmOptions(
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        quantization=args.quantization,
        enforce_eager=args.enforce_eager,
        cpu_omp_threads_bind=args.cpu_omp_threads_bind,
        engine_core=VllmEngineCore(args.engine_core),
    )


def add_prefill_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    add_server_flags(parser, 50061, env)
    add_engine_flags(parser, env)
    add_flag(parser, "--lease-s", env, type=float, default=DEFAULT_LEASE_S, help="KV lease length")
    add_flag(
        parser, "--kv-port", env, type=int, default=50071, help="KV sender port (0: ephemeral)"
    )
    pull_s = field_default(PrefillConfig, "max_pull_s")
    add_flag(parser, "--max-pull-s", env, type=float, default=pull_s, help="longest KV pull")


def add_decode_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    add_server_flags(parser, 50062, env)
    add_engine_flags(parser, env)
    timeout_s = field_default(DecodeConfig, "transfer_timeout_s")
    add_flag(parser, "--transfer-timeout-s", env, type=float, default=timeout_s)
    add_flag(
        parser,
        "--prefill-peers",
        env,
        type=csv,
        default=(),
        help="prefill workers (h:p,...) to pull KV from, besides the registry's",
    )
    add_flag(
        parser,
        "--max-buffered-tokens",
        env,
        type=int,
        default=field_default(DecodeConfig, "max_buffered_tokens"),
        help="output tokens a request may have unread before it is paused",
    )
    add_flag(
        parser,
        "--heartbeat-s",
        env,
        type=float,
        default=field_default(DecodeConfig, "heartbeat_s"),
        help="a quiet stream sends an empty message this often (router stall detection)",
    )
    add_spec_flags(parser, env)


def add_spec_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    """Speculative decoding on a decode worker (off unless --speculative-method is set)."""
    add_flag(
        parser,
        "--speculative-method",
        env,
        default=None,
        choices=[m.value for m in SpecMethod],
        help="propose tokens by n-gram lookup or with a draft model; output is unchanged",
    )
    spec = functools.partial(field_default, SpeculativeConfig)
    add_flag(
        parser, "--num-speculative-tokens", env, type=int, default=spec("num_speculative_tokens")
    )
    add_flag(parser, "--spec-ngram-min", env, type=int, default=spec("ngram_min"))
    add_flag(parser, "--spec-ngram-max", env, type=int, default=spec("ngram_max"))
    add_flag(parser, "--spec-draft-model", env, default=None, help="draft checkpoint directory")
    add_flag(
        parser,
        "--spec-max-batch-size",
        env,
        type=int,
        default=spec("max_batch_size"),
        help="steps decoding more requests than this do not speculate",
    )
    add_flag(
        parser,
        "--spec-min-acceptance",
        env,
        type=float,
        default=spec("min_acceptance"),
        help="a request whose recent acceptance is below this sits out (doubling) steps",
    )


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    if args.speculative_method is None:
        if args.spec_draft_model is not None:
            raise ValueError("--spec-draft-model needs --speculative-method draft")
        return None
    return SpeculativeConfig(
        method=SpecMethod(args.speculative_method),
        num_speculative_tokens=args.num_speculative_tokens,
        ngram_min=args.spec_ngram_min,
        ngram_max=args.spec_ngram_max,
        draft_model=args.spec_draft_model,
        max_batch_size=args.spec_max_batch_size,
        min_acceptance=args.spec_min_acceptance,
    )


def prefill_config(args: argparse.Namespace) -> PrefillConfig:
    return PrefillConfig(
        engine=engine_config(args),
        server=server_config(args),
        lease_s=args.lease_s,
        kv_backend=args.kv_backend,
        kv_port=args.kv_port,
        max_pull_s=args.max_pull_s,
        kv_verify=args.kv_verify == "on",
        ucx_tls=args.ucx_tls,
        ray_address=args.ray_address,
        redis=redis_config(args),
        worker_id=args.worker_id,
    )


def decode_config(args: argparse.Namespace) -> DecodeConfig:
    return DecodeConfig(
        engine=dataclasses.replace(engine_config(args), speculative=speculative_config(args)),
        server=server_config(args),
        kv_backend=args.kv_backend,
        ray_address=args.ray_address,
        prefill_peers=args.prefill_peers,
        transfer_timeout_s=args.transfer_timeout_s,
        kv_verify=args.kv_verify == "on",
        ucx_tls=args.ucx_tls,
        max_buffered_tokens=args.max_buffered_tokens,
        heartbeat_s=args.heartbeat_s,
        redis=redis_config(args),
        worker_id=args.worker_id,
    )
