"""pdserve's KV connector: vLLM's side of pdserve's block lifecycle (``kvtransfer/base.py``).

vLLM loads it by module path (``vllm_engine.args``) and builds two halves: the scheduler's, in
the engine core, which tells the front-end which blocks vLLM gave a request through a
``CoreChannel`` (``vllm_engine/core_channel.py``: the engine's ``Bridge`` when the engine core
runs in the worker's process, the hub when it runs in a process of its own); and one in every
worker rank. When that rank runs in the worker's process (tensor_parallel_size 1, the engine
core in the worker's process), pdserve's own KV sender and receiver (``kvtransfer``, under
pdserve's leases) read and write its pages through the bridge's ``VllmKVPages``. Otherwise its
half builds a ``RankRuntime`` in the rank's process that moves that rank's shard
(``vllm_engine/rank_runtime.py``), commanded by the front-end through the hub. Neither half
moves a byte in a step: KV moves while no step touches the blocks.

- Prefill (a request with mode ``prefill``, one token long): ``request_finished`` keeps its
  blocks (vLLM frees them only once reported finished sending) and records them as pinned. The
  lease's end (``Release``, expiry, abort, shutdown) releases them through the bridge, once;
  the report reaches vLLM at its next step, which frees them.
- Decode (mode ``remote``): ``get_num_new_matched_tokens`` claims the prompt tokens past vLLM's
  own (block-aligned) prefix hit as loaded asynchronously, so vLLM allocates their blocks and
  parks the request; ``update_state_after_alloc`` hands the blocks to ``admit_prefilled``, whose
  pull fills them (the hit's blocks, shared, are skipped: ``SKIP_BLOCK``).
  Its outcome is reported as finished receiving (a failure also as failed receiving, vLLM's
  failure path: the request ends and its blocks are freed). A preempted request recomputes.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import setproctitle
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.request import RequestStatus

from vllm_engine.bridge import Bridge, find_bridge
from vllm_engine.core_channel import CoreChannel, HubChannel
from vllm_engine.kv_pages import SKIP_BLOCK, VllmKVPages, page_halves, vllm_layout
from vllm_engine.rank_runtime import RankRuntime
from vllm_engine.request import PINNED_KEY, Mode
from vllm_engine.sampler import guide_compiler

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class _NoMetadata(KVConnectorMetadata):
    """Nothing travels with a step: the front-end tells each rank what it needs (the hub)."""


class PdserveConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._fingerprint, self._vllm_version = extra["pdserve_fingerprint"], extra["pdserve_vllm"]
        # The bridge when the engine core runs in the worker's process; the hub for a rank in
        # a process of its own, and for an engine core in one.
        hub_address, bridge_id = extra["pdserve_hub"], extra["pdserve_bridge"]
        self._hub_address: str = hub_address if role is KVConnectorRole.WORKER else ""
        self._bridge: Bridge | None = None
        self._channel: CoreChannel | None = None
        if role is KVConnectorRole.SCHEDULER and bridge_id:
            self._channel = find_bridge(bridge_id)
        elif role is KVConnectorRole.SCHEDULER:  # vLLM's engine core, in a process of its own
            # Named for what it is in ps/top/py-spy (vLLM called it VLLM::EngineCore); at
            # tensor_parallel_size 1 its one rank runs here too.
            setproctitle.setproctitle(f"{extra.get('pdserve_name', 'pdserve')} vllm engine core")
            self._channel = HubChannel(hub_address)
        elif not hub_address:
            self._bridge = find_bridge(bridge_id)
        self._runtime: RankRuntime | None = None
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError(
                f"pdserve moves one KV cache group; this model has "
                f"{len(kv_cache_config.kv_cache_groups)} (hybrid attention is not supported)"
            )
        self._num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else 0
        self._block_size = vllm_config.cache_config.block_size

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Heads outermost in each block's page (vLLM's ``LBHNC``, as its own NIXL connector
        asks): a rank's head range is then one run of each page, so engines of unequal tensor
        parallelism exchange KV (``vllm_engine/kv_pages.py``). vLLM's CPU backend has only
        this one; on CUDA it replaces FlashAttention's default (``LBNHC``), or vLLM drops it
        with a warning for a backend that cannot read it, and unequal TP is refused by name."""
        return "LBHNC"

    # ---- scheduler side (vLLM's step thread) ------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = _pdserve_params(request)
        if params is None or params["mode"] != Mode.REMOTE.value:
            return 0, False
        if not self._core.should_load(params["pdserve_rid"]):
            return 0, False  # loaded once already: a preempted request recomputes
        remaining = params["num_tokens"] - num_computed_tokens
        return remaining, remaining > 0  # 0: vLLM's own prefix cache holds it all

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = _pdserve_params(request)
        if params is None or params["mode"] != Mode.REMOTE.value:
            return
        if not self._core.should_load(params["pdserve_rid"]):
            return  # a later allocation (more blocks, a recompute): nothing to load
        block_ids = list(blocks.get_block_ids()[0][: params["num_blocks"]])
        # Leading blocks vLLM's prefix cache already holds (a block-aligned local hit) are
        # shared: the pull must not write them (VllmKVPages skips SKIP_BLOCK). When it holds
        # every one, vLLM waits for nothing: the pull only runs its course (and releases).
        num_local = (params["num_tokens"] - num_external_tokens) // self._block_size
        block_ids[:num_local] = [SKIP_BLOCK] * num_local
        self._core.allocated(
            params["pdserve_rid"],
            params["pdserve_attempt"],
            request.request_id,
            block_ids,
            waits=num_external_tokens > 0,
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return _NoMetadata()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = _pdserve_params(request)
        if params is None:
            return False, None
        self._core.finished(params["pdserve_rid"])
        if (
            params["mode"] != Mode.PREFILL.value
            or request.status is not RequestStatus.FINISHED_LENGTH_CAPPED
        ):
            return False, None
        self._core.pin(
            params["pdserve_rid"], params["pdserve_attempt"], request.request_id, list(block_ids)
        )
        # Freed once reported finished sending (the lease ended). The output says it was
        # pinned: the front-end holds it until the pin itself has reached it.
        return True, {PINNED_KEY: True}

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Every rank's reports of a step, aggregated: what vLLM frees or schedules now."""
        self._core.seen(
            connector_output.finished_sending or set(), connector_output.finished_recving or set()
        )

    @property
    def _core(self) -> CoreChannel:
        assert self._channel is not None, "the scheduler half's calls"
        return self._channel

    @property
    def _engine_bridge(self) -> Bridge:
        assert self._bridge is not None, "a rank in a process of its own has no bridge"
        return self._bridge

    # ---- worker side (vLLM's step thread) ---------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        layout = replace(self._layout(kv_caches), tp_size=tp_size, tp_rank=tp_rank)
        pages = VllmKVPages(list(kv_caches.values()), layout, self._num_blocks)
        if self._bridge is not None:
            self._bridge.kv_pages = pages
            return
        # Named for what it is in ps/top/py-spy (vLLM called it VLLM::Worker_TP<r>).
        name = self._kv_transfer_config.kv_connector_extra_config.get("pdserve_name", "pdserve")
        setproctitle.setproctitle(f"{name} vllm rank {tp_rank}")
        socket_dir = os.path.dirname(self._hub_address.removeprefix("unix://"))
        guides = guide_compiler(self._vllm_config)
        self._runtime = RankRuntime(pages, tp_rank, self._hub_address, socket_dir, guides)
        self._runtime.start()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return None  # pulls run between steps, before the request is scheduled

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return None  # prefill blocks are read in place, after the request finished

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        runtime = self._runtime
        reports = (
            runtime.take_reports() if runtime is not None else self._engine_bridge.take_reports()
        )
        return KVConnectorTransferResults(
            finished_sending=reports.finished_sending,
            finished_recving=reports.finished_recving,
            failed_recving=reports.failed_recving,
        )

    def _layout(self, kv_caches: dict[str, torch.Tensor]) -> Any:
        first_name, first = next(iter(kv_caches.items()))
        spec = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec
        _, shape = page_halves(first, self._num_blocks, spec.num_kv_heads)
        backend = _backend_name(self._vllm_config, first_name)
        page_layout = f"vllm-{self._vllm_version}/{backend}/{shape}"
        return vllm_layout(self._kv_cache_config, self._fingerprint, page_layout)


def _pdserve_params(request: Request) -> dict[str, Any] | None:
    params = request.kv_transfer_params
    if not params or "pdserve_rid" not in params:
        return None
    return params


def _backend_name(vllm_config: VllmConfig, layer_name: str) -> str:
    layer = vllm_config.compilation_config.static_forward_context.get(layer_name)
    get_backend = getattr(layer, "get_attn_backend", None)
    return str(get_backend().get_name()) if get_backend is not None else "unknown"
