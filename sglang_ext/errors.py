"""Errors of the core that callers tell apart."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request parameter is out of range; the message names the parameter."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
