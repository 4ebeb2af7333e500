"""OpenAI-shaped errors: every non-2xx response is {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from starlette.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class APIError(Exception):
    """An error the client sees as `status` + the OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        """The error as a server-sent event (after a stream has started; the OpenAI client raises on it)."""
        return f"data: {json.dumps(self.body())}\n\n"


def invalid(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


_TYPE_TAG = re.compile(r"[\[\]-]|^(str|int|float|bool|list|dict|none|function-\w+)$")


def _param(loc: tuple) -> str | None:
    """('messages', 0, 'content', 'str') -> 'messages[0].content' (union member tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _TYPE_TAG.search(str(part)):
            out += ("." if out else "") + str(part)
    return out or None


def from_validation_errors(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """A pydantic error list -> one 400 naming the first bad parameter."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        return invalid(
            f"request body is not valid JSON ({first.get('msg', '').removeprefix('Invalid JSON: ')})",
            None,
            "invalid_json",
        )
    if first.get("type") == "model_type" and not first.get("loc"):
        return invalid("request body must be a JSON object", None, "invalid_json")
    param = _param(tuple(first.get("loc", ())))
    msgs = []
    for e in errors:
        if _param(tuple(e.get("loc", ()))) == param and e["msg"] not in msgs:
            msgs.append(e["msg"])
    code = "missing_required_parameter" if first.get("type") == "missing" else "invalid_value"
    return invalid(f"{param or 'body'}: {' or '.join(msgs)}", param, code)
