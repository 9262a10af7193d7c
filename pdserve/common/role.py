"""What a pdserve process is: the one enum for roles, from the CLI's subcommands to the
registry's records and a Ray deployment's actors."""

from __future__ import annotations

import enum


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    ROUTER = "router"
    KVSTORE = "kvstore"  # a KV store (kvstore_service/): holds blocks workers offload

    @property
    def is_worker(self) -> bool:
        """It registers in Redis (a worker serving requests, or a KV store); the router does
        not."""
        return self is not Role.ROUTER


WORKER_ROLES = (Role.PREFILL, Role.DECODE)
