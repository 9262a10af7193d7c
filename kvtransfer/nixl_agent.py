"""One NIXL agent per KV cache (its tensors registered whole): the thin shell around ``nixl_cu12``
the NIXL sender and receiver share (``kvtransfer/nixl_sender.py``, ``nixl_receiver.py``).

NIXL is an optional extra: ``load_nixl`` fails with the install command when it is missing.
UCX settings: ``ucx_tls`` (``--ucx-tls``, default: UCX's own choice, which on one host reads
remote memory with a single copy through ``cma`` and on GPUs uses ``cuda_ipc``/RDMA) is put in
``UCX_TLS`` before the agent starts; any other ``UCX_*`` variable set by the operator applies as
is. Threads: NIXL's progress thread serves remote reads of this agent's memory (UCX transports
that are not one-sided need it, and so does connection set-up); the agent is called from the
event loop and from transfer threads, so it runs in NIXL's strict thread-sync mode.

The progress thread's wait: NIXL's Python wrapper hard-codes a 0 µs delay, which makes the
thread spin a full core while idle (measured: 3.0 CPU-s in 3 s idle; on a 2-core host both
workers' spinning threads cut a 64 MiB READ from 2.4 to 1.2 GB/s). ``PROGRESS_DELAY_US`` is
set instead: 0.03 CPU-s per 3 s idle, no measurable cost to a READ.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from types import ModuleType
from typing import Any

import numpy as np

from engine.kv_pages import KVPages
from kvtransfer.base import KVTransferError, TransferErrorCode
from kvtransfer.nixl_plan import Region, Row

INSTALL = (
    "the nixl KV backend needs NIXL: pip install -c requirements/constraints-cpu.txt "
    "'pdserve[nixl]' (CUDA hosts: the same extra under your CUDA constraints)"
)
_POLL_FIRST_S = 20e-6
_POLL_MAX_S = 1e-3
PROGRESS_DELAY_US = 1000
_construct = threading.Lock()
logger = logging.getLogger(__name__)


def load_nixl() -> ModuleType:
    try:
        import nixl_cu12._api as api
    except ImportError as exc:
        raise ImportError(f"{INSTALL} ({exc})") from None
    # NIXL logs to stdout on its own handler, where supervisors read a service's events: its
    # records go through the process's logging instead, warnings and up.
    nixl_logger = logging.getLogger("nixl")
    for handler in list(nixl_logger.handlers):
        nixl_logger.removeHandler(handler)
    nixl_logger.propagate = True
    nixl_logger.setLevel(logging.WARNING)
    return api


class ReadStopped(Exception):
    """The READ was stopped (the pull was cancelled) before it completed."""


class NixlAgent:
    def __init__(self, role: str, pages: KVPages, ucx_tls: str | None = None) -> None:
        api = load_nixl()
        if ucx_tls:
            os.environ["UCX_TLS"] = ucx_tls  # before UCX starts: it reads it once
        self.incarnation = uuid.uuid4().hex
        self.name = f"pdserve-{role}-{self.incarnation[:12]}"
        config = api.nixl_agent_config(
            backends=["UCX"], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        )
        self._agent: Any = _new_agent(api, self.name, config, PROGRESS_DELAY_US)
        spans = pages.spans()
        self.mem_type = "VRAM" if spans.on_device else "DRAM"
        # Once: the whole cache (every layer's tensor); a view's region lies inside it.
        self._registered = self._agent.register_memory(list(spans.tensors))
        self.key = _memory_key(role, pages)
        # READs in flight per remote agent, and remote agents to remove once they have none:
        # removing one disconnects it, which must not happen under a READ still polling it.
        self._lock = threading.Lock()
        self._reads: dict[str, int] = {}
        self._retired: set[str] = set()

    @property
    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def add_remote(self, metadata: bytes) -> str:
        name = self._agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_remote(self, name: str) -> None:
        """Forgets a remote agent: now, or when its last READ in flight has ended. Blocks
        (a disconnect): call it off the event loop."""
        with self._lock:
            if self._reads.get(name):
                self._retired.add(name)
                return
        self._remove(name)

    def busy(self) -> bool:
        """Whether any READ is in flight."""
        with self._lock:
            return any(self._reads.values())

    def _remove(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:  # already gone in NIXL: nothing left to remove
            logger.info("nixl remote agent %s not removed: %s", name, exc)

    def read(
        self,
        remote_agent: str,
        remote_mem_type: str,
        local_rows: list[Row],
        remote_rows: list[Row],
        stop: threading.Event,
        deadline_s: float,
    ) -> None:
        """One READ of ``remote_rows`` into ``local_rows``, polled to its end. Blocks its
        thread: run it off the event loop. Returns only once nothing writes into the local
        rows any more. Raises ``ReadStopped`` (``stop`` set), ``KVTransferError``."""
        with self._lock:
            self._reads[remote_agent] = self._reads.get(remote_agent, 0) + 1
        try:
            self._read(remote_agent, remote_mem_type, local_rows, remote_rows, stop, deadline_s)
        finally:
            with self._lock:
                self._reads[remote_agent] -= 1
                retired = False
                if not self._reads[remote_agent]:
                    del self._reads[remote_agent]
                    retired = remote_agent in self._retired
                    self._retired.discard(remote_agent)
            if retired:  # forgotten while this READ ran: removed now that nothing uses it
                self._remove(remote_agent)

    def _read(
        self,
        remote_agent: str,
        remote_mem_type: str,
        local_rows: list[Row],
        remote_rows: list[Row],
        stop: threading.Event,
        deadline_s: float,
    ) -> None:
        # It may have queued for a transfer thread: a READ that starts after its hold ended
        # could read blocks the sender already reused.
        if stop.is_set():
            raise ReadStopped()
        if time.monotonic() > deadline_s:
            raise KVTransferError(
                TransferErrorCode.UNAVAILABLE,
                f"NIXL READ from {remote_agent} not started before its deadline",
            )
        try:
            local_array = np.array(local_rows, dtype=np.uint64)
            remote_array = np.array(remote_rows, dtype=np.uint64)
            local = self._agent.get_xfer_descs(local_array, self.mem_type)
            remote = self._agent.get_xfer_descs(remote_array, remote_mem_type)
            handle = self._agent.initialize_xfer("READ", local, remote, remote_agent)
        except Exception as exc:  # the bindings' errors: nixlRemoteDisconnectError, ...
            raise _unavailable(remote_agent, exc) from None
        try:
            state = self._agent.transfer(handle)  # same-host cma reads complete right here
            pause = _POLL_FIRST_S
            while state == "PROC":
                if stop.is_set():
                    raise ReadStopped()
                if time.monotonic() > deadline_s:
                    raise KVTransferError(
                        TransferErrorCode.UNAVAILABLE,
                        f"NIXL READ from {remote_agent} did not finish in time",
                    )
                time.sleep(pause)
                pause = min(2 * pause, _POLL_MAX_S)
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise KVTransferError(
                    TransferErrorCode.UNAVAILABLE, f"NIXL READ from {remote_agent} failed"
                )
        except (KVTransferError, ReadStopped):
            raise
        except Exception as exc:
            raise _unavailable(remote_agent, exc) from None
        finally:
            self._release(handle)

    def _release(self, handle: Any) -> None:
        """Releases (aborting, if it still runs) a transfer; one that cannot be aborted yet is
        waited for: the caller may reuse the blocks as soon as this returns. How long that
        can take is UCX's to bound (its endpoint timeouts and keepalive; see the module
        docstring): returning earlier would let a late write land in reused blocks."""
        while True:
            try:
                self._agent.release_xfer_handle(handle)
                return
            except Exception as exc:  # nixlRepostActiveError: still in flight
                if self._agent.check_xfer_state(handle) != "PROC":
                    try:  # it ended meanwhile: now it can be released
                        self._agent.release_xfer_handle(handle)
                    except Exception:
                        logger.warning("nixl transfer handle not released: %s", exc)
                    return
                time.sleep(_POLL_MAX_S)

    def close(self) -> None:
        self._agent.deregister_memory(self._registered)


_shared: dict[tuple[str, tuple[int, ...]], tuple[NixlAgent, int]] = {}
_shared_lock = threading.Lock()


def acquire_agent(role: str, pages: KVPages, ucx_tls: str | None = None) -> NixlAgent:
    """The process's agent over ``pages``' memory (their base pages' tensors): shared by the
    receivers of several views of one cache (a decode rank reading several prefill ranks'
    shards into head ranges of its pages), so the memory is registered once. Each acquire is
    released once (``release_agent``); the last release closes it. Blocks: off the loop."""
    key = _memory_key(role, pages)
    with _shared_lock:
        agent, count = _shared.get(key) or (None, 0)
        if agent is None:
            agent = NixlAgent(role, pages, ucx_tls)
        _shared[key] = (agent, count + 1)
        return agent


def release_agent(agent: NixlAgent) -> None:
    with _shared_lock:
        shared, count = _shared[agent.key]
        if count > 1:
            _shared[agent.key] = (shared, count - 1)
            return
        del _shared[agent.key]
    agent.close()


def _memory_key(role: str, pages: KVPages) -> tuple[str, tuple[int, ...]]:
    return role, tuple(t.data_ptr() for t in pages.spans().tensors)


def region_of(pages: KVPages) -> Region:
    """Where ``pages``' slabs lie (a view's: inside its base pages' registered memory)."""
    spans = pages.spans()
    return Region(spans.bases, spans.strides, pages.num_blocks, spans.device_id)


def _new_agent(api: ModuleType, name: str, config: Any, delay_us: int) -> Any:
    """``api.nixl_agent(name, config)`` with the progress thread's delay set: the wrapper has
    no parameter for it, so its call into the bindings is intercepted (under a lock, restored
    at once) to set the one field before the agent starts."""
    bindings = api.nixlBind
    with _construct:
        make = bindings.nixlAgent

        def with_delay(agent_name: str, agent_config: Any) -> Any:
            agent_config.pthrDelay = delay_us
            return make(agent_name, agent_config)

        bindings.nixlAgent = with_delay
        try:
            return api.nixl_agent(name, config)
        finally:
            bindings.nixlAgent = make


def _unavailable(remote_agent: str, exc: Exception) -> KVTransferError:
    return KVTransferError(
        TransferErrorCode.UNAVAILABLE,
        f"NIXL READ from {remote_agent}: {type(exc).__name__} {exc}".strip(),
    )
