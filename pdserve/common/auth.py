"""API keys for a public endpoint (the router's gRPC API, its OpenAI HTTP API).

The keys come from a file, one per line (blank lines and ``#`` comments ignored), each
optionally followed by ``name=value`` attributes the router reads (``class=batch weight=2``:
docs/slo.md), and are read again whenever the file changes, so keys rotate without a
restart: add the new key, move the clients over, remove the old one. A request carries
``authorization: Bearer <key>``. Only a SHA-256 of each key is kept, and the comparison runs in
constant time over every key. Keys are never logged; refusals count in
``pdserve_auth_failures_total``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

_RECHECK_S = 1.0  # how often the file's modification time is looked at


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._digests: tuple[bytes, ...] = ()
        self._attributes: dict[bytes, dict[str, str]] = {}
        self._mtime_ns = -1
        self._checked_s = 0.0
        self._load()

    def _load(self) -> None:
        stat = os.stat(self.path)
        lines = [
            line.split()
            for line in self.path.read_text().splitlines()
            if line.strip() and not line.strip().startswith("#")
        ]
        if not lines:
            raise ValueError(f"api key file {self.path} holds no key")
        attributes = {}
        for n, (key, *pairs) in enumerate(lines, 1):
            split = [pair.partition("=") for pair in pairs]
            for pair, (name, sep, _) in zip(pairs, split, strict=True):
                if not (sep and name):  # never the key itself in the message
                    raise ValueError(
                        f"api key file {self.path}: key {n}: {pair!r} is not name=value"
                    )
            attributes[_digest(key)] = {name: value for name, _, value in split}
        keys = [line[0] for line in lines]
        self._digests = tuple(_digest(k) for k in keys)
        self._attributes = attributes
        self._mtime_ns = stat.st_mtime_ns
        logger.info("api keys: %d loaded from %s", len(keys), self.path)

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked_s < _RECHECK_S:
            return
        self._checked_s = now
        try:
            if os.stat(self.path).st_mtime_ns != self._mtime_ns:
                self._load()
        except (OSError, ValueError) as exc:  # keep the last good keys
            logger.error("api key file %s not reloaded: %s", self.path, exc)

    def allows(self, authorization: str | None) -> bool:
        """Whether an ``authorization`` header value (``Bearer <key>``) names a valid key."""
        self._refresh()
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            return False
        presented = _digest(key.strip())
        found = False
        for digest in self._digests:  # every key compared: the time says nothing of which
            found |= hmac.compare_digest(presented, digest)
        return found

    def attributes(self, authorization: str | None) -> dict[str, str]:
        """The attributes the file gives an allowed key (``allows`` checked it), else none."""
        _, _, key = (authorization or "").partition(" ")
        return dict(self._attributes.get(_digest(key.strip()), {}))

    @staticmethod
    def identity(authorization: str | None) -> str:
        """Who presents ``authorization`` (an allowed key), for per-caller accounting: a
        short digest of the key, never the key."""
        _, _, key = (authorization or "").partition(" ")
        return _digest(key.strip()).hex()[:16]


def bearer(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | None:
    """The ``authorization`` value of gRPC invocation metadata."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            return value.decode() if isinstance(value, bytes) else value
    return None
