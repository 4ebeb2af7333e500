"""`moa-serve serve`: build a backend, wrap it in the gateway app, run uvicorn with a graceful drain.

    app, backend = build_gateway(ServeOptions(...))      # the one place a server is wired (the CLI fills options)
    DrainingServer(uvicorn_config(app, host, port), app.state.gateway, backend, drain_timeout).run()

SIGTERM (or the first Ctrl-C): /ready turns 503 and new completion requests get 503 + Retry-After
while in-flight ones finish; the process exits as soon as none is left, or at the drain deadline
(then the rest are aborted). A second signal exits at once.

Slow clients: a request's head must arrive within --body-timeout of the connection opening (or of the
first byte after a keep-alive response), else the connection is closed; its body then within the same
time, else a 408 (serving/api/body.py). Open connections are capped at --max-connections (uvicorn's
limit_concurrency: a request beyond it gets uvicorn's plain-text 503 and the connection is closed).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from dataclasses import dataclass, field, fields

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..backends.base import Admission
from ..backends.embedded import EmbeddedLimits
from ..backends.sglang import UpstreamConfig
from ..config import EngineConfig
from ..metrics import Metrics
from .app import GatewayConfig, GatewayState
from .schemas import Limits

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeOptions:
    """Everything `moa-serve serve` wires together, one object (moa_serve/entrypoints/serve.py fills it from flags):
    a backend (the embedded engine, or an upstream SGLang server) behind the gateway app, with its
    limits, keys and the optional edge API."""

    served_name: str  # the `model` clients use
    engine: EngineConfig | None = None  # the embedded backend's engine (loaded by build_gateway)
    embedded: EmbeddedLimits | None = None
    upstream: UpstreamConfig | None = None  # the sglang backend (instead of engine)
    admission: Admission = field(default_factory=Admission)  # either backend's
    drafter_label: str = "none"  # the sglang backend's drafter label (the embedded one is its engine's)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    edge_drafters: str | None = None  # embedded: comma list of drafters for /v1/edge/sessions
    edge_ttl_s: float = 120.0

    def __post_init__(self):
        if (self.engine is None) == (self.upstream is None):
            raise ValueError("serve: one backend, the embedded engine or an upstream server")
        if self.upstream is not None and not self.upstream.url.startswith(("http://", "https://")):
            raise ValueError(f"--upstream must be an http(s) URL, got {self.upstream.url!r}")
        if self.edge_drafters and self.engine is None:
            raise ValueError(
                "--edge-drafters needs the embedded backend (the edge API runs the target in this process)"
            )

    @property
    def backend(self) -> str:
        return "embedded" if self.engine is not None else "sglang"


def build_gateway(o: ServeOptions, metrics: Metrics | None = None):
    """(app, backend) for the options: the embedded engine loaded (its model and drafter), or the upstream
    client; the edge API beside the embedded one when asked."""
    from ..backends.sglang import SGLangBackend
    from ..backends.telemetry import Telemetry
    from ..engine import build_engine
    from .app import create_app

    metrics = metrics or Metrics()
    if o.engine is not None:
        engine = build_engine(o.engine)
        lim = o.embedded or EmbeddedLimits()
        limits = {f.name: getattr(lim, f.name) for f in fields(lim)}
        name = engine.config.drafter or "none"
        backend, telemetry = embedded_backend(engine, o.served_name, name, metrics, o.admission, **limits)
    else:
        telemetry = Telemetry(metrics, o.drafter_label, "sglang")
        backend = SGLangBackend(o.upstream, [o.served_name], o.drafter_label, telemetry, o.admission)
    edge, edge_tok = (
        build_edge(backend.engine.target, o.edge_drafters, o.edge_ttl_s) if o.edge_drafters else (None, None)
    )
    return create_app(backend, telemetry, o.gateway, edge=edge, edge_tokenizer=edge_tok), backend


def embedded_backend(
    engine, model_id: str, drafter: str, metrics: Metrics | None = None, admission: Admission | None = None, **limits
):
    """(EmbeddedBackend, Telemetry) around an existing Engine (also for tests and benchmarks);
    limits: EmbeddedLimits fields."""
    from ..backends.embedded import EmbeddedBackend
    from ..backends.telemetry import Telemetry

    telemetry = Telemetry(metrics or Metrics(), drafter, "embedded")
    return EmbeddedBackend(engine, [model_id], drafter, telemetry, EmbeddedLimits(**limits), admission), telemetry


def build_edge(target, names: str, ttl_s: float):
    """EdgeService for the comma list of drafter names, and a messages -> token ids function."""
    from sglang_ext.drafters import make_drafter

    from ..edge.service import EdgeLimits, EdgeService

    drafters = {n: make_drafter(n, target) for n in names.split(",") if n}
    tok = (lambda msgs: target.encode_chat(msgs)) if target.tokenizer is not None else None
    return EdgeService(target, drafters, EdgeLimits(ttl_s=ttl_s)), tok


class HeadTimeoutProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline for each request head. uvicorn itself times out only
    idle keep-alive connections, so a client that connects and sends nothing, or sends its head a byte
    at a time, would hold its connection (one of --max-connections) for ever."""

    head_timeout_s = 30.0
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._awaiting_head():
            self._stop_head_timer()
        elif self._head_timer is None:  # the first bytes of the next request on a kept-alive connection
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def _awaiting_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._awaiting_head() and not self.transport.is_closing():
            self.transport.close()


def uvicorn_config(app, host: str, port: int, **kw) -> uvicorn.Config:
    """uvicorn's settings for a gateway app: its connection cap and request head deadline (app.state.limits;
    the defaults for an app without them, e.g. the gateway inside a test's ASGI middleware)."""
    limits: Limits = getattr(getattr(app, "state", None), "limits", None) or Limits()
    protocol = type("GatewayH11Protocol", (HeadTimeoutProtocol,), {"head_timeout_s": limits.body_timeout_s})
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol,
        limit_concurrency=limits.max_connections,
        timeout_graceful_shutdown=5,
        **kw,
    )


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains in-flight requests before shutting down."""

    def __init__(self, config: uvicorn.Config, state: GatewayState, backend, drain_timeout: float):
        super().__init__(config)
        self.state, self.backend, self.drain_timeout = state, backend, drain_timeout
        self._drain_started: float | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self._drain_started is None and sig in (signal.SIGTERM, signal.SIGINT):
            self.begin_drain()
            return
        super().handle_exit(sig, frame)  # second signal: shut down now

    def begin_drain(self) -> None:
        self._drain_started = time.monotonic()
        self.state.draining = True
        log.info("draining: %d request(s) in flight, deadline %.0f s", self.state.in_flight, self.drain_timeout)

    async def on_tick(self, counter: int) -> bool:
        if self._drain_started is not None and not self.should_exit:
            if self.state.in_flight <= 0:
                log.info("drained; shutting down")
                self.should_exit = True
            elif time.monotonic() - self._drain_started > self.drain_timeout:
                log.warning("drain deadline passed; aborting %d request(s)", self.state.in_flight)
                self.backend.abort_all()
                self.should_exit = True
            if self.should_exit:
                self.state.close()  # requests still uploading their bodies get an OpenAI-shaped 503
        return await super().on_tick(counter)


class ServerThread:
    """Run an app with uvicorn in a background thread on 127.0.0.1 (tests, benchmarks).

    with ServerThread(app) as srv:
        httpx.get(srv.url + "/health")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.server = uvicorn.Server(uvicorn_config(app, host, port, log_level=log_level, access_log=False))
        self._thread = threading.Thread(target=self.server.run, name="moa-uvicorn", daemon=True)
        self.host = host

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(30)
