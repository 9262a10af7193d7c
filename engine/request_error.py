"""The error a request's own parameters end it with, on any engine and at any point of a step.

Raised where a request cannot go on because of what it asked for, never because of the engine:
no token may follow (its grammar allows only tokens its ``bad_words`` or ``min_tokens`` ban:
``engine/token_bans.py``), its grammar's matcher failed (a step past its lexer budget), an id
outside the vocabulary. The engine ends that one request (finish reason ``error``, the message
on its last update) and the batch goes on; the serving contract raises it from the request's
stream (``engine/serving_engine.py``), the worker answers INVALID_ARGUMENT, and the router's
failure table gives it back to the client (HTTP 400) without a migration: it would fail the
same way on any worker. An exception that is not this one, raised by a step, is an engine
fault: the engine is dead and the worker restarts.
"""

from __future__ import annotations


class RequestError(ValueError):
    """A request's own failure; the message names the fields (and the limit) behind it."""


class OutsideGrammar(RequestError):
    """A token its grammar does not allow reached a guided request's output: the row it came
    from allowed nothing (a grammar's mask never allows it otherwise), so the caller names
    what ruled every token out (``engine/request_state.py``)."""


class RequestIdInUse(ValueError):
    """Refused at intake: the request id names a request the engine holds (running, pinned or
    reserved). INVALID_ARGUMENT; the request holding the id is not the refused call's, so the
    caller must leave it alone (never abort the id it was refused)."""

    @classmethod
    def of(cls, request_id: str) -> RequestIdInUse:
        return cls(f"request_id {request_id!r} is already in use")
