"""Ray's own object accounting, cluster-wide: which objects some process still references.

Asks every live raylet for its workers' reference tables (what ``ray memory`` shows), so small
objects kept in a worker's in-process store count as well as those in shared memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray

# The ids of actor handles' creation objects: references to actors, not to data.
_ACTOR_HANDLE_PREFIX = "ff" * 8


@dataclass(frozen=True)
class LiveObject:
    object_id: str
    size_bytes: int  # -1 while pending
    pid: int  # a process that references it
    call_site: str


def live_objects() -> list[LiveObject]:
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import node_manager_pb2, node_manager_pb2_grpc

    found = []
    request = node_manager_pb2.GetNodeStatsRequest(include_memory_info=True)  # type: ignore[attr-defined]
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        channel = init_grpc_channel(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}")
        try:
            stub = node_manager_pb2_grpc.NodeManagerServiceStub(channel)
            reply = stub.GetNodeStats(request, timeout=10)
        finally:
            channel.close()
        for worker in reply.core_workers_stats:
            for ref in worker.object_refs:
                object_id = ref.object_id.hex()
                if not object_id.startswith(_ACTOR_HANDLE_PREFIX):
                    found.append(LiveObject(object_id, ref.object_size, worker.pid, ref.call_site))
    return found
