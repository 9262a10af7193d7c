"""The workers a process last read from the registry, kept in a local file so that a restart
during a Redis outage still knows its peers (Redis is an accelerator, not a dependency).

Who writes: the router (every worker) and decode workers (their prefill peers), after each
registry read whose membership changed. Who reads: the same process after a restart, only
while the registry cannot be read. A record from the file is a candidate, never trusted as it
stands: the router routes to it only once it answers ``GetStats`` with the same KV layout, a
decode worker pulls from it only once it answers with its KV sender's address. The file is
JSON of the registry's own string fields (nothing is pickled), written atomically; in Kubernetes
it lives in an ``emptyDir``, which outlives a container restart.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

from pdserve.cluster.registry import WorkerRecord

logger = logging.getLogger(__name__)

MAX_FILE_BYTES = 4 << 20  # far above any real fleet's records; a bound on what is parsed


class LastKnownWorkers:
    def __init__(self, path: str | None) -> None:
        self.path = Path(path) if path else None
        self._written: frozenset[tuple[str, str, str]] | None = None

    def save(self, records: list[WorkerRecord]) -> None:
        """Writes ``records`` when the membership (id, address, KV sender) changed. A failure
        to write is logged, never raised: serving does not depend on this file."""
        if self.path is None:
            return
        membership = frozenset((r.worker_id, r.address, r.kv_address) for r in records)
        if membership == self._written:
            return
        text = json.dumps([r.to_redis() for r in records])
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, self.path)
        except OSError as exc:
            logger.warning("could not write last-known workers to %s: %s", self.path, exc)
            return
        self._written = membership

    def load(self) -> list[WorkerRecord]:
        """The records last saved ([] without a file); malformed ones are skipped, named."""
        if self.path is None or not self.path.exists():
            return []
        try:
            if self.path.stat().st_size > MAX_FILE_BYTES:
                raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
            raw = json.loads(self.path.read_text())
            if not isinstance(raw, list):
                raise ValueError("not a list of records")
        except (OSError, ValueError) as exc:
            logger.warning("ignoring last-known workers in %s: %s", self.path, exc)
            return []
        records = []
        for item in raw:
            try:
                if not isinstance(item, dict):
                    raise ValueError("a record is not an object")
                fields = {str(k).encode(): str(v).encode() for k, v in item.items()}
                records.append(WorkerRecord.from_redis(fields))
            except ValueError as exc:
                logger.warning("ignoring a last-known worker in %s: %s", self.path, exc)
        return records
