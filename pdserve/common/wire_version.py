"""The version of pdserve's internal wire (``proto/pdserve/v1``: the worker RPCs a router makes).

Workers say theirs in their stats and their registry records; a router refuses, by name, a
worker that speaks another version (``router/worker_pool.py``), so that a rolling upgrade never
pairs a router with a worker whose messages mean something else. Raise it whenever a message's
meaning changes.

- 0: a worker from before versions were sent (its stats and records carry none).
- 2: typed events: a decode stream's ``DecodeResponse`` is one of heartbeat, admitted, queued,
  tokens, finished; a ``PrefillResponse`` ends in a lease or a finish.
"""

from __future__ import annotations

WIRE_VERSION = 2
