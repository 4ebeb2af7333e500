"""The one way a request body (and JSON carried inside one) becomes Python values, on every route.

    read_body(request)   the bytes, up to --max-body-bytes (413 above); a client that goes away mid-upload
                         raises ClientGone (an abort, not a server error)
    load_json(raw)       JSON text -> values: nesting deeper than MAX_JSON_DEPTH, NaN/Infinity, invalid
                         UTF-8 and malformed text are a 400 (code invalid_json), never a RecursionError
    parse(model, raw)    load_json, then a pydantic schema (a 400 naming the first bad parameter)

NOTE: the depth is measured on the raw bytes before anything is decoded (numpy, linear in the body),
so no decoder, validator or grammar compiler downstream ever sees more than MAX_JSON_DEPTH levels.
"""

from __future__ import annotations

import asyncio
import json
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
    """Text that load_json refuses; the message says why."""


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


def load_json(data: bytes | str, what: str = "request body") -> Any:
    """JSON text -> values; JSONError (what: how the message names the text) for anything else."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if nesting_depth(raw) > MAX_JSON_DEPTH:
        raise JSONError(f"{what} nests arrays and objects more than {MAX_JSON_DEPTH} levels deep")
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except JSONError:
        raise
    except RecursionError:  # NOTE: unreachable under the depth limit; kept so no input can escape as a 500
        raise JSONError(f"{what} nests arrays and objects too deeply") from None
    except ValueError as e:  # malformed text, invalid UTF-8, an integer of more than 4300 digits
        raise JSONError(f"{what} is not valid JSON ({e})") from None


def load_body(raw: bytes) -> Any:
    """load_json for a whole request body: a 400 (code invalid_json) when it is not JSON."""
    try:
        return load_json(raw)
    except JSONError as e:
        raise invalid(str(e), None, "invalid_json") from None


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


async def read_body(request: Request, limit: int, closing: asyncio.Event | None = None) -> bytes:
    """The request body, at most `limit` bytes (413 above). ClientGone when the client leaves mid-upload;
    a 503 when `closing` is set first (the server finished draining: an upload never holds a shutdown)."""
    too_big = APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit:
        raise too_big
    if closing is None:
        return await _read(request, limit, too_big)
    read = asyncio.ensure_future(_read(request, limit, too_big))
    stop = asyncio.ensure_future(closing.wait())
    try:
        await asyncio.wait({read, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not read.done():
            read.cancel()
            await asyncio.gather(read, return_exceptions=True)
    if read.cancelled():
        raise shutting_down()
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
