"""Telling a prefill worker it may free a lease, off the request's path (fire and forget).

Who ends a lease, and when, is the contract in ``kvtransfer/base.py``; both callers of this
(the router before a decode worker admits a request, the decode worker after its pull) use this
one client. A lost or failed release is logged and left to the lease's expiry, the backstop.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from pdserve.common.channels import ChannelPool
from pdserve.v1 import prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)

DEFAULT_RELEASE_TIMEOUT_S = 5.0
# Trailing metadata of a Decode call that failed after the worker admitted it and ended the
# lease (a failed pull): the handle is spent, so the router prefills again rather than offering
# it to another decode worker, which could only answer NOT_FOUND.
LEASE_ENDED = ("pdserve-lease", "ended")


class LeaseReleaser:
    def __init__(self, channels: ChannelPool, timeout_s: float = DEFAULT_RELEASE_TIMEOUT_S) -> None:
        self.channels = channels
        self.timeout_s = timeout_s
        self._pending: set[asyncio.Task[None]] = set()

    def release_later(self, prefill_address: str, request_id: str, lease_token: str) -> None:
        """Sends ``Release`` (with the lease's token, from its handle) in a task the caller
        does not await: a cancelled request must still end its lease, and the token stream
        must not wait for the answer."""
        if not prefill_address:
            return
        release = self._release(prefill_address, request_id, lease_token)
        task = asyncio.get_running_loop().create_task(release)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _release(self, prefill_address: str, request_id: str, lease_token: str) -> None:
        stub = prefill_pb2_grpc.PrefillWorkerStub(self.channels.get(prefill_address))
        request = prefill_pb2.ReleaseRequest(request_id=request_id, lease_token=lease_token)
        try:
            await stub.Release(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            logger.warning(
                "request_id=%s release at %s failed (%s); the lease will expire",
                request_id,
                prefill_address,
                exc.code().name,
            )

    async def close(self) -> None:
        """Waits (bounded by ``timeout_s`` each) for releases still on the wire."""
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
