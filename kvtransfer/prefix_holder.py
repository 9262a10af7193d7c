"""The holder half of a peer pull (docs/kv-cache.md), written once for both holders: a prefill
worker (its cached prefix) and a KV store (its pool). Their services inherit ``PrefixHolderRpcs``
for the lease RPCs of ``PrefillWorker`` and build their ``LeasePrefix`` answer with
``prefix_lease``; what each pins, and how, is theirs."""

from __future__ import annotations

import grpc

from kvtransfer.base import KVSender, prompt_digest
from kvtransfer.lease_manager import LeaseManager
from kvtransfer.wire import handle_to_proto
from pdserve.v1 import prefill_pb2


def lease_prefix_refusal(
    request: prefill_pb2.LeasePrefixRequest, block_size: int, max_len: int
) -> str | None:
    """Why a ``LeasePrefix`` request is refused (``INVALID_ARGUMENT``), or None: its token ids
    must be whole blocks, at most ``max_len`` of them, and ``first_block`` one of their
    blocks."""
    n = len(request.prompt_token_ids)
    if not n or n % block_size or n > max_len:
        return (
            f"prompt_token_ids must be whole blocks of {block_size} tokens, at most max_len "
            f"({max_len}), got {n}"
        )
    if not 0 <= request.first_block < n // block_size:
        return f"first_block {request.first_block} out of range [0, {n // block_size})"
    return None


def prefix_lease(
    sender: KVSender,
    lease_id: str,
    num_blocks: int,
    lease_s: float,
    token: str,
    request: prefill_pb2.LeasePrefixRequest,
) -> prefill_pb2.LeasePrefixResponse:
    """The answer for ``num_blocks`` blocks pinned from ``request.first_block`` under a lease
    (none: nothing was pinned): a handle naming this holder's sender and the digest of the
    prompt's tokens up to the last block leased."""
    if not num_blocks:
        return prefill_pb2.LeasePrefixResponse()
    end = (request.first_block + num_blocks) * sender.layout.block_size
    digest = prompt_digest(list(request.prompt_token_ids[:end]))
    handle = sender.handle(lease_id, num_blocks, lease_s, token, digest)
    return prefill_pb2.LeasePrefixResponse(lease=handle_to_proto(handle))


class PrefixHolderRpcs:
    """``Release`` and ``RenewLease`` of ``PrefillWorker``, over the holder's ``leases``."""

    leases: LeaseManager

    async def Release(
        self, request: prefill_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.ReleaseResponse:
        released = await self.leases.end(request.request_id, request.lease_token)
        return prefill_pb2.ReleaseResponse(released=released)

    async def RenewLease(
        self, request: prefill_pb2.RenewLeaseRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.RenewLeaseResponse:
        renewed = self.leases.renew(request.request_id, request.lease_token)
        return prefill_pb2.RenewLeaseResponse(renewed=renewed, lease_s=self.leases.lease_s)
