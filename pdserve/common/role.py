"""What a pdserve process is: the one enum for roles, from the CLI's subcommands to the
registry's records and a Ray deployment's actors."""

from __future__ import annotations

import enum


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    ROUTER = "router"

    @property
    def is_worker(self) -> bool:
        """A worker (it registers in Redis and serves requests); the router is not one."""
        return self is not Role.ROUTER


WORKER_ROLES = (Role.PREFILL, Role.DECODE)
