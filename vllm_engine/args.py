"""pdserve's engine config as vLLM's engine arguments (pure: a mapping, tested with exact values).

One name per setting: each pdserve flag maps to the vLLM argument of the same meaning, and the
options only vLLM has (``VllmOptions``) keep vLLM's names. What is not mapped is refused by
``EngineConfig`` before anything starts (docs/engines.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig, VllmEngineCore, VllmOptions

# Where vLLM finds pdserve's pieces (it loads them by module path).
CONNECTOR_MODULE = "vllm_engine.connector"
CONNECTOR_CLASS = "PdserveConnector"
SAMPLER_CLASS = "vllm_engine.sampler:PdserveSampler"


def engine_core_for(options: VllmOptions, *, on_cpu: bool) -> VllmEngineCore:
    """Where vLLM's engine core runs: as asked, or (``auto``) in the worker's process for one
    rank on a CPU, where it was measured faster (docs/benchmarks.md: vLLM's CPU build gives the
    rank a process of its own besides the engine core's, and on a worker's one core their
    shared-memory queues poll against each other), and in a process of its own otherwise."""
    if options.engine_core is not VllmEngineCore.AUTO:
        return options.engine_core
    if on_cpu and options.tensor_parallel_size == 1:
        return VllmEngineCore.WORKER
    return VllmEngineCore.PROCESS


@dataclass(frozen=True)
class ConnectorTarget:
    """Where vLLM's two halves of pdserve's connector find the engine: the bridge (in the
    engine's process) and, with tensor parallelism, the hub the ranks dial; and what names the
    KV layout (none of it secret: vLLM logs its config)."""

    bridge_id: str
    fingerprint: str
    vllm_version: str
    hub_address: str = ""  # "": the one rank runs in the engine's process
    process_name: str = "pdserve"  # the worker's (ps): its ranks are "<it> vllm rank <r>"


def engine_args(
    config: EngineConfig, target: ConnectorTarget, *, on_cpu: bool, events: str = ""
) -> dict[str, Any]:
    """The keyword arguments of ``vllm.engine.arg_utils.EngineArgs`` for ``config``.

    vLLM samples every token greedily from logits pdserve's own sampler (the logits processor)
    has already decided (``vllm_engine/sampler.py``), decodes no text and stops at no token of
    its own: pdserve applies stop tokens, stop strings and lengths (``engine.request_state``).
    With tensor parallelism vLLM's ranks run in processes of their own, started by vLLM's
    multiprocess executor (on one node: the ranks dial the hub's Unix socket). ``events``: the
    ZMQ endpoint an engine core in a process of its own publishes its KV cache events on (""
    when it runs in the worker's process, whose engine buffers them itself); such an engine
    core reports its stats too (pdserve's stat logger reads them).
    """
    cache, scheduler, options = config.cache, config.scheduler, config.vllm
    kv_bytes = cache.kv_cache_bytes
    if kv_bytes is None and on_cpu:
        kv_bytes = DEFAULT_CPU_KV_CACHE_BYTES  # vLLM would size it from free RAM
    args: dict[str, Any] = {
        "model": config.model,
        "dtype": config.dtype,
        "max_model_len": config.max_model_len,
        "block_size": cache.block_size,
        "enable_prefix_caching": cache.enable_prefix_caching,
        # vLLM keeps block 0 as its null block: ask for one more than pdserve will use.
        "num_gpu_blocks_override": None if cache.num_blocks is None else cache.num_blocks + 1,
        "kv_cache_memory_bytes": kv_bytes,
        "max_num_seqs": scheduler.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "scheduling_policy": scheduler.scheduling_policy.value,  # the same priority values
        "tensor_parallel_size": options.tensor_parallel_size,
        "quantization": options.quantization,
        "enforce_eager": options.enforce_eager,
        # The sampler reads each request's output so far at every step: no step runs ahead.
        "async_scheduling": False,
        "logprobs_mode": "raw_logprobs",  # pdserve's logprobs are the raw model's
        "logits_processors": [SAMPLER_CLASS],
        "seed": 0,
        "disable_log_stats": not events,
        "kv_transfer_config": {
            "kv_connector": CONNECTOR_CLASS,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "pdserve_bridge": target.bridge_id,
                "pdserve_hub": target.hub_address,
                "pdserve_fingerprint": target.fingerprint,
                "pdserve_vllm": target.vllm_version,
                "pdserve_name": target.process_name,
            },
        },
        # Events on: published on ``events``, or (null publisher) replaced by the in-process
        # engine's own buffer (vllm_engine.events).
        "kv_events_config": (
            {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events}
            if events
            else {"enable_kv_cache_events": True, "publisher": "null"}
        ),
    }
    if options.tensor_parallel_size > 1:
        # Never Ray's executor (a placement group would pick it): the ranks must be local.
        args["distributed_executor_backend"] = "mp"
    if options.gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = options.gpu_memory_utilization
    return args
