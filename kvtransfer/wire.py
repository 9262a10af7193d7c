"""``KVHandle`` <-> protobuf: the transfer handle as it travels prefill -> router -> decode."""

from __future__ import annotations

from kvtransfer.base import KVHandle
from pdserve.common.convert import layout_from_proto, layout_to_proto
from pdserve.v1 import prefill_pb2


def handle_to_proto(handle: KVHandle) -> prefill_pb2.KVHandle:
    return prefill_pb2.KVHandle(
        backend=handle.backend,
        address=handle.address,
        request_id=handle.request_id,
        num_blocks=handle.num_blocks,
        layout=layout_to_proto(handle.layout),
        lease_s=handle.lease_s,
        lease_token=handle.lease_token,
        prompt_digest=handle.prompt_digest,
    )


def handle_from_proto(msg: prefill_pb2.KVHandle) -> KVHandle:
    """Raises ValueError (naming the fields) on a handle that cannot be pulled."""
    if not msg.backend or not msg.address or not msg.request_id or msg.num_blocks < 1:
        raise ValueError("handle must carry backend, address, request_id and num_blocks >= 1")
    return KVHandle(
        backend=msg.backend,
        address=msg.address,
        request_id=msg.request_id,
        num_blocks=msg.num_blocks,
        layout=layout_from_proto(msg.layout),
        lease_s=msg.lease_s,
        lease_token=msg.lease_token,
        prompt_digest=msg.prompt_digest,
    )
