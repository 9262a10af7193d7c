"""The one refusal of a request's content: a 400 naming the parameter at fault (errors.py
writes it in OpenAI's error shape)."""

from __future__ import annotations


class InvalidParameter(ValueError):
    """A 400 naming ``param``."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
