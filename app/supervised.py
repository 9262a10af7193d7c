"""A component started by a supervisor (``pdserve up``, the test clusters: ``LocalCluster``):
its config on the first line of its stdin, stdin then held open as its lifeline, and its name.

- The lifeline. The supervisor keeps the pipe's write end for the child's whole life and never
  writes to it again. When the supervisor is gone (stopped, crashed, or killed with SIGKILL)
  the pipe closes, and the child drains and exits as on SIGTERM: no component outlives its
  supervisor, with no polling. (A parent-death signal, ``PR_SET_PDEATHSIG``, would fire when
  the *thread* that started the child ends, and the supervisor restarts components from
  threads.)
- The process group. The supervisor starts each child in a process group of its own, so a
  terminal's Ctrl-C reaches the supervisor alone, which stops the components in order
  (``LocalCluster.stop``): never every process at once.
- The name: ``pdserve <component>`` in ps, top and py-spy (``setproctitle``); a vLLM worker's
  rank processes take ``<its name> vllm rank <r>`` (``vllm_engine/connector.py``).
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import threading
from typing import TextIO

import setproctitle

from app.settings import ServiceConfig, role_of
from router.config import RouterConfig

logger = logging.getLogger(__name__)


def piped(stream: TextIO) -> bool:
    """Whether ``stream`` is a pipe: a supervisor's (a config read from a file is not)."""
    try:
        return stat.S_ISFIFO(os.fstat(stream.fileno()).st_mode)
    except (OSError, ValueError):
        return False


def follow_lifeline(stream: TextIO) -> None:
    """From now on, the end of ``stream``, a supervisor's pipe (the supervisor gone), is a
    SIGTERM to this process: the graceful drain every component runs on SIGTERM. A stream that
    cannot be read is no lifeline: it is left alone, logged."""

    def follow() -> None:
        try:
            while stream.read(4096):
                pass  # the supervisor writes nothing more; bytes would be ignored
        except (OSError, ValueError) as exc:
            logger.warning("the supervisor's lifeline cannot be read (%s): not followed", exc)
            return
        logger.warning("supervisor gone (its lifeline closed): draining")
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=follow, name="pdserve-lifeline", daemon=True).start()


def process_title(config: ServiceConfig) -> str:
    """``pdserve router``; a worker by its registry id (``pdserve decode-0-3f9a1c`` under
    ``pdserve up``), which names its role, else ``pdserve decode``."""
    role = role_of(config).value
    worker_id = None if isinstance(config, RouterConfig) else config.worker_id
    if not worker_id:
        return f"pdserve {role}"
    return f"pdserve {worker_id}" if worker_id.startswith(role) else f"pdserve {role} {worker_id}"


def name_process(title: str) -> None:
    """What ps, top and py-spy show for this process."""
    setproctitle.setproctitle(title)
