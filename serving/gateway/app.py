"""The OpenAI-compatible FastAPI app: /v1/chat/completions, /v1/completions, /v1/models, /health, /ready, /metrics,
/tokenize and /detokenize (also under /v1), and SGLang's native /generate.

Every error is OpenAI-shaped, FastAPI's own 404/405/422 and unexpected 500s included. Each
completion request is counted once in moa_requests_total by how it ended: ok, invalid (4xx from
validation), rejected (429 queue full, 503 draining), aborted (client went away), error (5xx).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from urllib.parse import parse_qsl

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..api.body import ClientGone, read_body, shutting_down
from ..api.errors import APIError, from_validation_errors
from ..backends.base import Backend
from ..backends.telemetry import Telemetry
from ..tenancy import DEFAULT_TENANT, Tenant
from .auth import APIKeys, key_id, tenant_key
from .generation import ChatFormat, CompletionFormat, Generation
from .native import NativeGeneration, generate_jobs, model_info, server_info
from .schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Limits,
    TokenizeRequest,
    chat_jobs,
    completion_jobs,
    parse,
    tokenize_jobs,
)

log = logging.getLogger(__name__)

try:
    VERSION = importlib.metadata.version("moa-serve")
except importlib.metadata.PackageNotFoundError:  # a source tree that was not installed
    VERSION = "unknown"

DEFAULT_AUTH_EXEMPT = ("/health", "/ready", "/metrics")


@dataclass
class GatewayConfig:
    limits: Limits = field(default_factory=Limits)
    api_keys: APIKeys | None = None
    auth_exempt: tuple[str, ...] = DEFAULT_AUTH_EXEMPT


@dataclass
class GatewayState:
    """NOTE: a request counts as in flight only once its body is read: an upload that stalls must not
    hold the SIGTERM drain; when the drain ends, `closed` is set and such uploads get a 503."""

    draining: bool = False
    in_flight: int = 0  # completion requests not yet finished (responses still streaming included)
    closed: asyncio.Event | None = None  # set when the server stops taking requests (made on the event loop)

    def enter(self) -> None:
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1

    def close(self) -> None:
        """The drain is over (event loop thread): requests still uploading their bodies get a 503."""
        if self.closed is not None:
            self.closed.set()


class SSEResponse(StreamingResponse):
    """A text/event-stream response that always runs `on_close` (client gone, finished, or failed)."""

    def __init__(self, content, on_close):
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


@dataclass
class _Gateway:
    """What the route groups share."""

    backend: Backend
    telemetry: Telemetry
    config: GatewayConfig
    state: GatewayState

    async def body_of(self, request: Request) -> bytes:
        limits = self.config.limits
        return await read_body(request, limits.max_body_bytes, self.state.closed, limits.body_timeout_s)


def create_app(
    backend: Backend, telemetry: Telemetry, config: GatewayConfig | None = None, edge=None, edge_tokenizer=None
) -> FastAPI:
    """edge: an optional serving.edge.EdgeService to expose the client–server session API."""
    gw = _Gateway(backend, telemetry, config or GatewayConfig(), GatewayState())

    @asynccontextmanager
    async def lifespan(app):
        gw.state.closed = asyncio.Event()
        await backend.start()
        try:
            yield
        finally:
            await backend.close()

    app = FastAPI(title="moa-serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gw.state
    app.state.backend = backend
    app.state.limits = gw.config.limits  # (the server's settings: uvicorn_config)
    _install_error_handlers(app)
    if gw.config.api_keys is not None and gw.config.api_keys.enabled:
        app.add_middleware(_AuthMiddleware, keys=gw.config.api_keys, exempt=gw.config.auth_exempt)
    _add_status_routes(app, gw)
    _add_generation_routes(app, gw)
    _add_native_info_routes(app, gw)
    _add_token_routes(app, gw)
    if edge is not None:
        from ..edge.routes import install_edge_routes

        install_edge_routes(app, edge, gw.body_of, edge_tokenizer)
    return app


def _add_status_routes(app: FastAPI, gw: _Gateway) -> None:
    """/health, /ready, /metrics and /v1/models."""
    backend = gw.backend

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        reason = "the server is shutting down" if gw.state.draining else await backend.not_ready_reason()
        if reason:
            raise APIError(503, reason, code="not_ready")
        return {"status": "ready", "backend": backend.kind, "model": backend.model_ids[0], "drafter": backend.drafter}

    @app.get("/metrics")
    async def metrics():
        gw.telemetry.occupancy(*backend.load())
        gw.telemetry.kv_cache(backend.kv_cache())
        keys = gw.config.api_keys
        gw.telemetry.tenants.declare(keys.tenant_names() if keys is not None else [DEFAULT_TENANT.name])
        return Response(generate_latest(gw.telemetry.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(m) for m in backend.model_ids]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id not in backend.model_ids:
            raise _model_not_found(model_id)
        return _model_card(model_id)


def _add_generation_routes(app: FastAPI, gw: _Gateway) -> None:
    """/v1/chat/completions, /v1/completions and SGLang's native /generate."""

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _completion(gw, request, _openai_request(gw, ChatCompletionRequest, chat_jobs, ChatFormat))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _completion(gw, request, _openai_request(gw, CompletionRequest, completion_jobs, CompletionFormat))

    @app.post("/generate")
    async def generate(request: Request):
        """SGLang's native API (gateway/native.py)."""
        return await _completion(gw, request, lambda body, key, owner: _native_request(gw, body, key, owner))


async def _completion(gw: _Gateway, request: Request, build):
    """Run one generation request; build(body, api key id, tenant) -> (Generation, stream?) parses and validates
    it. Counted once in moa_requests_total (and per tenant) by how it ended, and in flight from its whole body on."""
    state, telemetry = gw.state, gw.telemetry
    owner: Tenant = getattr(request.state, "tenant", DEFAULT_TENANT)
    entered = handed_off = False
    try:
        if state.draining:
            raise shutting_down()
        body = await gw.body_of(request)
        if state.draining:  # the drain began during the upload
            raise shutting_down()
        state.enter()
        entered = True
        gen, stream = build(body, getattr(request.state, "api_key_id", ""), owner)
        if not stream:
            return JSONResponse(await _collect(request, gen, telemetry, owner.name))
        await _open(request, gen)
        handed_off = True
        return SSEResponse(gen.stream(), on_close=lambda: _close_stream(gen, telemetry, state, owner.name))
    except APIError as e:
        telemetry.request(_status_of(e), owner.name)
        if e.status >= 500 and e.code != "service_unavailable":  # (a drain logs its own rejections)
            log.warning("request failed: %s %s", e.status, e.message)
        raise
    except ClientGone:
        telemetry.request("aborted", owner.name)
        return Response(status_code=499)
    except Exception as e:
        telemetry.request("error", owner.name)
        log.exception("unexpected error in %s", request.url.path)
        raise APIError(500, "internal server error", code="internal_error") from e
    finally:
        if entered and not handed_off:
            state.leave()


def _openai_request(gw: _Gateway, schema, make_jobs, fmt):
    """build(body, api key id, tenant) for an OpenAI completion endpoint: its schema, job builder and response
    format."""

    def build(body: bytes, api_key_id: str, owner: Tenant) -> tuple[Generation, bool]:
        req = parse(schema, body)
        _check_model(req.model, gw.backend)
        include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
        tenant = tenant_key(api_key_id, req.cache_salt)
        gen = Generation(
            gw.backend,
            gw.telemetry,
            [replace(j, tenant=tenant, owner=owner) for j in make_jobs(req, gw.config.limits)],
            req.model or gw.backend.model_ids[0],
            fmt,
            include_usage,
            bool(req.return_token_ids),
        )
        return gen, bool(req.stream)

    return build


def _native_request(gw: _Gateway, body: bytes, api_key_id: str, owner: Tenant) -> tuple[Generation, bool]:
    if gw.backend.kind != "embedded":  # an upstream SGLang serves /generate itself, with its own output ids
        raise APIError(
            400,
            "/generate is served by the upstream SGLang server with --backend sglang: call its /generate",
            code="unsupported_parameter",
        )
    jobs, batched, stream, logprobs = generate_jobs(body, gw.config.limits, api_key_id)
    jobs = [replace(j, owner=owner) for j in jobs]
    return NativeGeneration(gw.backend, gw.telemetry, jobs, batched, logprobs), stream


def _add_native_info_routes(app: FastAPI, gw: _Gateway) -> None:
    """SGLang's native server and model info, and its /flush_cache."""

    @app.get("/get_model_info")
    async def get_model_info():
        return model_info(gw.backend)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info():
        return server_info(gw.backend, gw.telemetry, VERSION)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        """SGLang's: empties the prefix cache (the embedded engine's, or the upstream's); requests running keep what
        they use until they end, and the message says so."""
        success, message = await gw.backend.flush_cache()
        return {"success": success, "message": message}


def _add_token_routes(app: FastAPI, gw: _Gateway) -> None:
    """/tokenize and /detokenize, also under /v1."""
    backend = gw.backend

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(request: Request):
        """{"tokens", "count", "max_model_len"}: the ids a completion would run with (lists for a list of prompts)."""
        req = parse(TokenizeRequest, await gw.body_of(request))
        _check_model(req.model, backend)
        jobs, batched = tokenize_jobs(req)
        ids = await asyncio.to_thread(lambda: [backend.tokenize(j) for j in jobs])  # a long text takes a while
        counts = [len(x) for x in ids]
        return {
            "tokens": ids if batched else ids[0],
            "count": counts if batched else counts[0],
            "max_model_len": backend.context_length(),
        }

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(request: Request):
        req = parse(DetokenizeRequest, await gw.body_of(request))
        _check_model(req.model, backend)
        batched = bool(req.tokens) and isinstance(req.tokens[0], list)
        texts = await asyncio.to_thread(
            lambda: [backend.detokenize(list(x)) for x in (req.tokens if batched else [req.tokens])]
        )
        return {"text": texts if batched else texts[0]}


async def _collect(request: Request, gen: Generation, telemetry: Telemetry, tenant: str) -> dict | list:
    """A non-streamed response's body (the generation closed whatever happens)."""
    try:
        result = await _race_disconnect(request, gen.collect())
    finally:
        await gen.close()
    _finished(telemetry, gen, tenant)
    return result


async def _open(request: Request, gen: Generation) -> None:
    """Every choice's first chunk, so errors before the stream starts become its HTTP status."""
    try:
        await _race_disconnect(request, gen.open())
    except BaseException:
        await gen.close()
        raise


def _finished(telemetry: Telemetry, gen: Generation, tenant: str) -> None:
    telemetry.e2e.observe(time.monotonic() - gen.t0)
    telemetry.request("ok", tenant)


async def _close_stream(gen: Generation, telemetry: Telemetry, state: GatewayState, tenant: str) -> None:
    try:
        await gen.close()
    finally:
        state.leave()
    if gen.completed:
        _finished(telemetry, gen, tenant)
    elif gen.failed is not None:
        telemetry.request(_status_of(gen.failed), tenant)
    else:
        telemetry.request("aborted", tenant)


def _status_of(e: APIError) -> str:
    if e.status in (429, 503):
        return "rejected"
    return "error" if e.status >= 500 else "invalid"


def _check_model(model_id: str | None, backend: Backend) -> None:
    if model_id is not None and model_id not in backend.model_ids:
        raise _model_not_found(model_id)


def _model_card(model_id: str) -> dict:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "moa-serve"}


def _model_not_found(model_id: str) -> APIError:
    return APIError(404, f"The model `{model_id}` does not exist on this server", param="model", code="model_not_found")


async def _race_disconnect(request: Request, coro):
    """Run `coro` unless the client disconnects first (then cancel it and raise ClientGone)."""
    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        raise ClientGone()
    return work.result()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# where else clients put API keys (x-api-key: Anthropic's and others'; api-key: Azure OpenAI's; query parameters)
_OTHER_KEY_HEADERS = (b"x-api-key", b"api-key")
_KEY_QUERY_PARAMS = ("api_key", "api-key", "key", "access_token")


class _AuthMiddleware:
    """Bearer API keys for every path except the exempt ones (pure ASGI: streaming is untouched). A request
    carries exactly one key: two Authorization headers, or one beside a key in x-api-key / api-key / the query
    string, is a 400 (which one would count is the kind of ambiguity a proxy and this server could read apart)."""

    def __init__(self, app, keys: APIKeys, exempt: tuple[str, ...]):
        self.app, self.keys, self.exempt = app, keys, set(exempt)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.exempt:
            return await self.app(scope, receive, send)
        headers = scope.get("headers") or []
        auths = [v.decode("latin-1") for k, v in headers if k == b"authorization"]
        ambiguity = _ambiguity(auths, headers, scope.get("query_string") or b"")
        if ambiguity:
            return await APIError(400, ambiguity, code="ambiguous_api_key").response()(scope, receive, send)
        tenant = self.keys.tenant_of(auths[0] if auths else None)
        if tenant is None:
            err = APIError(
                401,
                "Invalid or missing API key. Send 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            return await err.response()(scope, receive, send)
        state = scope.setdefault("state", {})
        state["api_key_id"] = key_id(auths[0])  # (request.state: the prefix cache namespace's first half)
        state["tenant"] = tenant  # fair admission, per-tenant metrics
        return await self.app(scope, receive, send)


def _ambiguity(auths: list[str], headers, query: bytes) -> str | None:
    """Why a request's API key is ambiguous, or None (the messages name places, never a key)."""
    if len(auths) > 1:
        return f"send one Authorization header; this request has {len(auths)}"
    if not auths:
        return None
    others = [k.decode() for k, _ in headers if k in _OTHER_KEY_HEADERS]
    params = {name for name, _ in parse_qsl(query.decode("latin-1"), keep_blank_values=True)}
    others += [f"the query parameter {p!r}" for p in _KEY_QUERY_PARAMS if p in params]
    if others:
        return f"send the API key in the Authorization header only; this request also has one in {others[0]}"
    return None


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        if e.status_code == 404:
            err = APIError(404, f"Not found: {request.method} {request.url.path}", code="not_found")
        elif e.status_code == 405:
            err = APIError(
                405, f"Method {request.method} is not allowed for {request.url.path}", code="method_not_allowed"
            )
        else:
            err = APIError(e.status_code, str(e.detail), code=None)
        err.headers.update(getattr(e, "headers", None) or {})
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        return from_validation_errors(list(e.errors())).response()

    @app.exception_handler(ClientGone)
    @app.exception_handler(ClientDisconnect)
    async def client_gone(request, e: Exception):
        # nobody reads this response: the client left (mid-upload) before it; not a server error
        log.debug("client left before the response: %s %s", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, "internal server error", code="internal_error").response()
