"""Grammar work off the serving paths: a bounded pool of compile worker processes (grammar_worker.py).

    backend.generate(job) ──► pool.prepare(job's grammar, job's tools) ──► Prepared(spec, compiled)
        cache hit                 at once (an LRU bounded in bytes; a refusal is kept as well)
        the same work in flight   wait for it (a request's n choices share one compile)
        else                      wait for a free worker (beyond max_waiting waiters: 429), send the job,
                                  wait at most timeout_s for its answer: past it the worker is ended and the
                                  request gets a 400 naming the budget; when every waiter has gone (the
                                  client left), the worker is ended too

A worker checks the limits first (sglang_ext/grammar.py: GrammarLimits), then converts, checks that the
grammar can match text, and compiles. The engine thread only ever receives a compiled grammar: a request
waits here, on the gateway's side, never in an engine step, and no lock is shared with the engine thread.
NOTE: processes, not threads: xgrammar cannot stop a compile, and ending the process is the only way to
get its core back. A worker's start (~3 s: Python, torch, xgrammar) is not counted in the budget.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

from sglang_ext.errors import InvalidRequest
from sglang_ext.grammar import TOO_COMPLEX, GrammarLimits, Grammars, GrammarSpec

from .api.errors import APIError
from .api.tools import ToolCalling
from .grammar_worker import HEADER, encode_frame

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent  # the directory holding the `serving` package
MAX_CACHE_ENTRIES = 4096


@dataclass(frozen=True)
class GrammarConfig:
    workers: int = 2  # compile worker processes at most (--grammar-workers)
    timeout_s: float = 10.0  # one request's grammar work in a worker (--grammar-timeout); a 400 past it
    max_waiting: int = 64  # requests waiting for a free worker; a 429 beyond
    cache_bytes: int = 256 << 20  # compiled grammars kept, least recently used out first
    limits: GrammarLimits = GrammarLimits()
    start_timeout_s: float = 120.0  # a worker's start (not in the budget); a 503 past it

    def __post_init__(self):
        if self.workers < 1 or self.timeout_s <= 0 or self.max_waiting < 0:
            raise ValueError("grammar workers must be >= 1, the compile timeout > 0 and max_waiting >= 0")


@dataclass(frozen=True)
class Prepared:
    """A request's grammar, ready: the spec the output must match (for tools under "required", the call
    grammar built from them; None under "auto") and its compiled form (None without a vocabulary: an
    upstream SGLang compiles for itself)."""

    spec: GrammarSpec | None
    compiled: Any = None


class GrammarFault(Exception):
    """The grammar work failed on the server's side (a worker died or raised): a 500 for this request."""


class _Refusal(NamedTuple):
    message: str
    param: str | None
    code: str | None

    def error(self) -> APIError:
        return APIError(400, self.message, param=self.param, code=self.code or "invalid_value")


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    async def call(self, message: dict, timeout: float) -> bytes:
        """The worker's answer to one message (its JSON bytes); TimeoutError past `timeout`."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(encode_frame(message))
        await self.proc.stdin.drain()
        return await asyncio.wait_for(self._read(), timeout)

    async def _read(self) -> bytes:
        assert self.proc.stdout is not None
        header = await self.proc.stdout.readexactly(HEADER)
        return await self.proc.stdout.readexactly(int.from_bytes(header, "big"))

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()


class _Flight:
    def __init__(self, task: asyncio.Task):
        self.task, self.waiters = task, 0


class GrammarPool:
    """grammars: the vocabulary to compile for (an embedded engine's); None to check and convert only.
    on_result(result): each answer, by how it came (cached, or a worker job: compiled, refused, timeout,
    cancelled, busy, failed)."""

    def __init__(
        self,
        grammars: Grammars | None,
        config: GrammarConfig = GrammarConfig(),
        on_result: Callable[[str], None] | None = None,
    ):
        self.grammars, self.config, self.on_result = grammars, config, on_result
        self._slots: asyncio.Semaphore | None = None  # made on the event loop
        self._waiting = 0
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._ending: set[asyncio.Task] = set()  # ended workers being reaped
        self._flights: dict[str, _Flight] = {}
        self._cache: OrderedDict[str, tuple[Prepared | _Refusal, int]] = OrderedDict()
        self._cache_size = 0
        self._info: str | None = None

    async def prepare(self, grammar: GrammarSpec | None, tools: ToolCalling | None) -> Prepared | None:
        """A request's grammar (response_format, regex, ebnf) and tools, checked and compiled; None when it
        has neither. APIError for the client (400 naming the parameter and the limit or budget; 429 when too
        many wait), GrammarFault for the server."""
        if grammar is None and tools is None:
            return None
        job = {
            "grammar": None if grammar is None else [grammar.kind, grammar.source, grammar.param],
            "tools": None if tools is None else tools.payload(),
        }
        key = hashlib.sha256(json.dumps(job, sort_keys=True).encode()).hexdigest()
        if (hit := self._cache.get(key)) is not None:
            self._cache.move_to_end(key)
            if self.on_result is not None:
                self.on_result("cached")
            return _result(hit[0])
        flight = self._flights.get(key)
        if flight is None or flight.task.cancelling():  # (a flight being ended serves no new waiter)
            param = grammar.param if grammar is not None else "tools"
            flight = self._flights[key] = _Flight(asyncio.ensure_future(self._run(key, job, param)))
            flight.task.add_done_callback(lambda t: self._landed(key, flight))
        flight.waiters += 1
        try:
            return _result(await asyncio.shield(flight.task))
        finally:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.task.done():
                flight.task.cancel()  # every client of this work has gone: end it

    def _landed(self, key: str, flight: _Flight) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]
        if not flight.task.cancelled():
            flight.task.exception()  # (retrieved: a flight whose waiters all left as it ended logs nothing)

    async def _run(self, key: str, job: dict, param: str) -> Prepared | _Refusal:
        """One flight: the job in a worker, its outcome cached and counted (on_result)."""
        result = "failed"
        try:
            outcome = await asyncio.to_thread(self._outcome, await self._call(job))
            result = "refused" if isinstance(outcome, _Refusal) else "compiled"
            self._remember(key, outcome)
            return outcome
        except TimeoutError:  # NOTE: not cached: a compile that was slow under load may fit the budget later
            result = "timeout"
            return _Refusal(
                f"{param}: the grammar took longer than this server's compile budget of {self.config.timeout_s:g} s; "
                "simplify it",
                param,
                TOO_COMPLEX,
            )
        except asyncio.CancelledError:
            result = "cancelled"
            raise
        except APIError as e:
            result = {400: "refused", 429: "busy"}.get(e.status, "failed")
            raise
        finally:
            if self.on_result is not None:
                self.on_result(result)

    async def _call(self, job: dict) -> bytes:
        """The answer of a free worker; the worker is ended when it is past the budget (TimeoutError), nobody
        waits any more (cancelled), or it died (GrammarFault)."""
        worker: _Worker | None = await self._acquire()
        assert worker is not None
        try:
            return await worker.call(job, self.config.timeout_s)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            self._end(worker)
            worker = None
            raise GrammarFault("a grammar compile worker died") from e
        except BaseException:
            self._end(worker)
            worker = None
            raise
        finally:
            self._release(worker)

    def _outcome(self, reply: bytes) -> Prepared | _Refusal:
        msg = json.loads(reply)
        if "refused" in msg:
            return _Refusal(**msg["refused"])
        if "error" in msg:
            log.error("grammar work failed in a compile worker:\n%s", msg["error"])
            raise GrammarFault("grammar work failed in a compile worker")
        spec = GrammarSpec(*msg["spec"]) if msg["spec"] else None
        assert self.grammars is not None or msg["compiled"] is None
        return Prepared(spec, self.grammars.load(msg["compiled"]) if msg["compiled"] else None)

    def _remember(self, key: str, outcome: Prepared | _Refusal) -> None:
        if isinstance(outcome, _Refusal):
            size = len(key) + len(outcome.message)
        else:
            size = len(key) + (len(outcome.spec.source) if outcome.spec is not None else 0)
            size += outcome.compiled.memory_size_bytes if outcome.compiled is not None else 0
        self._cache[key] = (outcome, size)
        self._cache_size += size
        while self._cache and (self._cache_size > self.config.cache_bytes or len(self._cache) > MAX_CACHE_ENTRIES):
            self._cache_size -= self._cache.popitem(last=False)[1][1]

    # --- workers ------------------------------------------------------------------------------
    async def _acquire(self) -> _Worker:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.config.workers)
        if self._slots.locked() and self._waiting >= self.config.max_waiting:
            busy = f"the grammar compilers are busy ({self._waiting} requests wait); retry in a moment"
            raise APIError(429, busy, code="rate_limit_exceeded", headers={"Retry-After": "1"})
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        try:
            worker = self._idle.pop() if self._idle else await self._start()
        except BaseException:
            self._slots.release()
            raise
        self._busy.add(worker)
        return worker

    def _release(self, worker: _Worker | None) -> None:
        if worker is not None:
            self._busy.discard(worker)
            self._idle.append(worker)
        assert self._slots is not None
        self._slots.release()

    def _end(self, worker: _Worker) -> None:
        self._busy.discard(worker)
        worker.kill()
        task = asyncio.ensure_future(worker.proc.wait())
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def _start(self) -> _Worker:
        info = await self._vocabulary()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "serving.grammar_worker",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            cwd=ROOT,  # NOTE: `-m` imports from the working directory first: this tree's package, not another's
        )
        worker = _Worker(proc)
        try:
            ready = await worker.call({"info": info, "limits": asdict(self.config.limits)}, self.config.start_timeout_s)
            if json.loads(ready) != {"ready": True}:
                raise ConnectionError(f"unexpected first message {ready[:100]!r}")
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError) as e:
            self._end(worker)
            log.error("a grammar compile worker did not start: %r", e)
            raise APIError(
                503, "structured output is unavailable: the grammar compiler did not start", code="service_unavailable"
            ) from e
        except BaseException:
            self._end(worker)
            raise
        return worker

    async def _vocabulary(self) -> str | None:
        """The tokenizer info workers compile for (built once, off the event loop); None: compile nothing."""
        if self.grammars is not None and self._info is None:
            try:
                self._info = await asyncio.to_thread(self.grammars.info_json)
            except InvalidRequest as e:  # a model without a tokenizer
                raise APIError(400, str(e), param=e.param, code="unsupported_parameter") from None
        return self._info

    async def close(self) -> None:
        """End the work in flight and every worker."""
        flights = [f.task for f in self._flights.values()]
        for task in flights:
            task.cancel()  # (each ends its busy worker)
        await asyncio.gather(*flights, return_exceptions=True)
        for worker in self._idle:
            self._end(worker)
        self._idle.clear()
        await asyncio.gather(*self._ending, return_exceptions=True)


def _result(outcome: Prepared | _Refusal) -> Prepared:
    if isinstance(outcome, _Refusal):
        raise outcome.error()
    return outcome
