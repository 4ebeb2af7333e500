"""The edge session API on the gateway (plain HTTP/1.1 keep-alive: one request per draft–verify
cycle is all the protocol needs; a persistent connection removes the handshake, and the binary
response frame keeps each cycle to a few hundred bytes per token).

    POST   /v1/edge/sessions                {"prompt_token_ids" | "messages", "drafter", "dtype"} -> frame
    POST   /v1/edge/sessions/{id}/verify    {"seq_len", "tokens", "parents", "mode"}             -> frame
    DELETE /v1/edge/sessions/{id}

Requests are JSON, responses are binary frames (protocol.py); errors are OpenAI-shaped JSON.
Auth is the gateway's (Bearer API keys) since these paths are not exempt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from starlette.responses import Response

from ..api.body import load_object
from ..api.errors import APIError, invalid
from .protocol import MEDIA_TYPE, pack
from .service import EdgeError, EdgeService

BodyReader = Callable[[Request], Awaitable[bytes]]


def install_edge_routes(app: FastAPI, service: EdgeService, read_body: BodyReader, tokenizer=None) -> None:
    """read_body: the gateway's body reader (size limit, client gone, shutdown); JSON goes through its one parser."""

    async def body_of(request: Request) -> dict:
        return load_object(await read_body(request))

    def int_list(body: dict, key: str, required: bool = True) -> list[int]:
        val = body.get(key)
        if val is None and not required:
            return []
        if not isinstance(val, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in val):
            raise invalid(f"{key} must be a list of integers", key)
        return val

    @app.post("/v1/edge/sessions")
    async def create(request: Request):
        if getattr(app.state, "edge_reaper", None) is None:
            app.state.edge_reaper = asyncio.create_task(reaper())
        body = await body_of(request)
        if "messages" in body:
            if tokenizer is None:
                raise invalid("this server takes prompt_token_ids only (no tokenizer)", "messages")
            msgs = body["messages"]
            if not isinstance(msgs, list) or not all(_is_message(m) for m in msgs):
                raise invalid("messages must be a list of {role, content}", "messages")
            try:
                prompt = await asyncio.to_thread(tokenizer, msgs)
            except Exception as e:  # noqa: BLE001 - a template error is the request's fault (roles out of order, ...)
                raise invalid(f"messages could not be formatted with the model's chat template: {e}", "messages") from e
        else:
            prompt = int_list(body, "prompt_token_ids")
        name = body.get("drafter") or next(iter(service.drafters))  # (a name: the service holds the drafters)
        dtype = body.get("dtype", "fp16")
        if not isinstance(name, str) or not isinstance(dtype, str):
            raise invalid("drafter and dtype must be strings", "drafter")
        try:
            header, tensors = await asyncio.to_thread(service.create, prompt, name, dtype)
        except EdgeError as e:
            raise APIError(e.status, e.message, param=e.param, code=e.code) from e
        header["prompt_token_ids"] = prompt
        return Response(pack(header, tensors, dtype), media_type=MEDIA_TYPE)

    @app.post("/v1/edge/sessions/{sid}/verify")
    async def verify(sid: str, request: Request):
        body = await body_of(request)
        seq_len = body.get("seq_len")
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 0:
            raise invalid("seq_len must be a non-negative integer", "seq_len")
        tokens, parents = int_list(body, "tokens"), int_list(body, "parents")
        if any(not -1 <= p < len(parents) for p in parents):
            raise invalid("parents must be node indices: -1 (the root) or 0 to len(tokens) - 1", "parents")
        mode = body.get("mode", "tree")
        try:
            header, tensors = await asyncio.to_thread(service.verify, sid, seq_len, tokens, parents, mode)
        except EdgeError as e:
            raise APIError(e.status, e.message, param=e.param, code=e.code) from e
        return Response(
            pack(header, tensors, service.sessions[sid].dtype if sid in service.sessions else "fp16"),
            media_type=MEDIA_TYPE,
        )

    @app.delete("/v1/edge/sessions/{sid}")
    async def close(sid: str):
        if not await asyncio.to_thread(service.close, sid):
            raise APIError(404, f"no edge session {sid!r}", code="session_not_found")
        return {"id": sid, "deleted": True}

    async def reaper():
        while True:  # expired sessions free their KV even if no request arrives
            await asyncio.sleep(min(5.0, service.limits.ttl_s / 2))
            await asyncio.to_thread(service.reap)


def _is_message(m) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
