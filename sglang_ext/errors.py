"""Errors of the core that callers tell apart."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request parameter is out of range; the message names the parameter. `code`: the API error code
    when it says more than "invalid_value" (e.g. a grammar over a limit)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code
