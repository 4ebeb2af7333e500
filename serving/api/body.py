"""The one way a request body (and JSON carried inside one) becomes Python values, on every route.

    read_body(request)   the bytes, up to --max-body-bytes (413 above); a client that goes away mid-upload
                         raises ClientGone (an abort, not a server error)
    load_json(raw)       JSON text -> values: bytes that are not UTF-8, nesting deeper than MAX_JSON_DEPTH,
                         NaN/Infinity and malformed text are a 400 (code invalid_json), never a RecursionError;
                         a string that is not text (a lone surrogate, which only a \\u escape can make) is a
                         400 naming its field, so no tokenizer ever sees one
    parse(model, raw)    load_json, then a pydantic schema (a 400 naming the first bad parameter)

NOTE: a body is UTF-8 or refused (RFC 8259 §8.1: JSON exchanged between systems is UTF-8), so the depth,
measured on its bytes before the decoder runs (numpy, linear in the body), is the decoded document's: in
UTF-8 a byte below 0x80 is always that ASCII character, while in UTF-16 a code unit such as U+0122 holds a
quote byte that would hide brackets from the scan. No decoder, validator or grammar compiler downstream
ever sees more than MAX_JSON_DEPTH levels.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import re
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from .errors import APIError, from_validation_errors, invalid

MAX_JSON_DEPTH = 128  # arrays/objects inside each other: a chat body needs 4, a tool's JSON schema 2 per level

M = TypeVar("M", bound=BaseModel)


class ClientGone(Exception):
    """The client disconnected before the response started (mid-upload or while waiting)."""


class JSONError(ValueError):
    """Text that load_json refuses; the message says why, `param` names the field when one is to blame."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_json"):
        super().__init__(message)
        self.param, self.code = param, code


def nesting_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text; brackets inside strings do not count
    (a quote delimits a string unless an odd run of backslashes precedes it): `{"a": ["[\\"]", {}]}` -> 3."""
    a = np.frombuffer(raw, dtype=np.uint8)
    if not a.size:
        return 0
    idx = np.arange(a.size)
    not_backslash = np.where(a != 0x5C, idx, -1)
    last_other = np.maximum.accumulate(not_backslash)  # the last non-backslash at or before each byte
    run_before = idx - 1 - np.concatenate(([-1], last_other[:-1]))  # backslashes just before each byte
    delimiter = (a == 0x22) & (run_before % 2 == 0)
    outside = np.cumsum(delimiter) % 2 == 0
    opens = outside & ((a == 0x5B) | (a == 0x7B))
    closes = outside & ((a == 0x5D) | (a == 0x7D))
    return int(np.cumsum(opens.astype(np.int64) - closes).max(initial=0))


def _no_constant(name: str):
    raise JSONError(f"{name} is not a JSON number")


def load_json(data: bytes | str, what: str = "request body", field: str | None = None) -> Any:
    """JSON text -> values; JSONError (what: how the message names the text) for anything else. field: the
    API parameter whose string holds this JSON (None: the text is a whole body, and a string that is not
    text is named by its place in it, e.g. messages[0].content)."""
    text = _utf8(data, what) if isinstance(data, bytes) else data
    raw = data if isinstance(data, bytes) else text.encode("utf-8", "surrogatepass")
    if nesting_depth(raw) > MAX_JSON_DEPTH:
        raise JSONError(f"{what} nests arrays and objects more than {MAX_JSON_DEPTH} levels deep")
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except JSONError:
        raise
    except RecursionError:  # NOTE: unreachable under the depth limit; kept so no input can escape as a 500
        raise JSONError(f"{what} nests arrays and objects too deeply") from None
    except ValueError as e:  # malformed text, an integer of more than 4300 digits
        raise JSONError(f"{what} is not valid JSON ({e})") from None
    if _MAY_HOLD_SURROGATE.search(text):
        _check_text(value, field)
    return value


def _utf8(data: bytes, what: str) -> str:
    """A body's text: UTF-8 (a leading byte order mark is dropped, as RFC 8259 allows), JSONError otherwise."""
    try:
        return data.removeprefix(codecs.BOM_UTF8).decode("utf-8")
    except UnicodeDecodeError as e:
        raise JSONError(
            f"{what} is not UTF-8 text (byte {e.start}: {e.reason}); JSON between systems must be UTF-8 (RFC 8259)"
        ) from None


# a lone surrogate is the one thing a str can hold that is not text (UTF-8 cannot encode it); decoded JSON
# gets one only from a \uD800-\uDFFF escape without its pair
_MAY_HOLD_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]|[\ud800-\udfff]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_text(value: Any, field: str | None) -> None:
    """JSONError naming the first string (or key) holding a lone surrogate, in document order."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        v, path = stack.pop()
        children: list[tuple[Any, str]] = []
        key = False
        if isinstance(v, dict):
            bad = next((m for k in v if (m := _SURROGATE.search(k))), None)
            children, key = [(x, f"{path}.{k}" if path else k) for k, x in v.items()], True
        elif isinstance(v, list):
            bad, children = None, [(x, f"{path}[{i}]") for i, x in enumerate(v)]
        else:
            bad = _SURROGATE.search(v) if isinstance(v, str) else None
        if bad:
            raise _not_text(bad.group(), field, path, key)
        stack.extend(reversed(children))


def _not_text(char: str, field: str | None, path: str, key: bool) -> JSONError:
    where = (f"{field} (at {path})" if path else field) if field else path or "the body"
    return JSONError(
        f"{'a key of ' if key else ''}{where} holds a lone surrogate (\\u{ord(char):04x}), which is not text: send "
        "valid Unicode",
        field or path or None,
        "invalid_value",
    )


def load_body(raw: bytes) -> Any:
    """load_json for a whole request body: a 400 (code invalid_json) when it is not JSON."""
    try:
        return load_json(raw)
    except JSONError as e:
        raise invalid(str(e), e.param, e.code) from None


def load_field(text: str, param: str, expect: str) -> Any:
    """JSON carried in a string parameter (a tool call's arguments, /generate's json_schema): load_json, or a
    400 naming the parameter (`expect`: what it must hold, added to a JSON error)."""
    try:
        return load_json(text, param, field=param)
    except JSONError as e:
        raise invalid(f"{e}: {expect}" if e.code == "invalid_json" else str(e), param) from None


def load_object(raw: bytes) -> dict:
    """A request body that must be a JSON object."""
    body = load_body(raw)
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object", None, "invalid_json")
    return body


def parse(model: type[M], raw: bytes) -> M:
    """A request body validated by a pydantic schema."""
    body = load_body(raw)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise from_validation_errors(e.errors(include_url=False)) from None


async def read_body(
    request: Request, limit: int, closing: asyncio.Event | None = None, timeout: float | None = None
) -> bytes:
    """The request body, at most `limit` bytes (413 above), all of it within `timeout` seconds (a 408, and
    the connection is closed: a stalled upload holds nothing for long). ClientGone when the client leaves
    mid-upload; a 503 when `closing` is set first (the server finished draining: an upload never holds a
    shutdown)."""
    too_big = APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit:
        raise too_big
    read = asyncio.ensure_future(_read(request, limit, too_big))
    stop = asyncio.ensure_future(closing.wait()) if closing is not None else None
    try:
        await asyncio.wait({read} | ({stop} if stop else set()), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if stop is not None:
            stop.cancel()
        if not read.done():
            read.cancel()
            await asyncio.gather(read, return_exceptions=True)
    if read.cancelled():
        if closing is not None and closing.is_set():
            raise shutting_down()
        raise APIError(
            408,
            f"the request body did not arrive within {timeout:g} s; the connection is closed",
            code="request_timeout",
            headers={"Connection": "close"},
        )
    return read.result()


async def _read(request: Request, limit: int, too_big: APIError) -> bytes:
    body = bytearray()
    try:
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise too_big
    except ClientDisconnect:
        raise ClientGone() from None
    return bytes(body)


def shutting_down() -> APIError:
    message = "the server is shutting down; retry on another replica"
    return APIError(503, message, code="service_unavailable", headers={"Retry-After": "5"})
