"""Ray helpers for tests: object leak checks through Ray's own accounting."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from app.ray_deploy.objects import live_objects


@contextmanager
def no_new_objects(timeout_s: float = 10.0) -> Iterator[None]:
    """Fails if objects created inside the block are still referenced anywhere afterwards.
    Ray frees asynchronously (reference counts travel between processes), hence the bound."""
    before = {o.object_id for o in live_objects()}
    yield
    deadline = time.monotonic() + timeout_s
    while True:
        new = [o for o in live_objects() if o.object_id not in before]
        if not new:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"Ray objects outlived the test: {new}")
        time.sleep(0.05)
