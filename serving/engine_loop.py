"""The engine thread: continuous batching behind a bounded admission queue, tokens delivered to asyncio.

    event loop (gateway)                 engine thread (owns Engine; nothing else touches it)
    ────────────────────                 ───────────────────────────────────────────────────
    submit(ids, params) ──► pending ──►  admit the fair next while running < max_running (or its tenant runs
          │   (FairQueue, per tenant)    fewer than its share of them) and KV fits
          │   (full: QueueFull → 429)    engine.step()  (one forward: arrivals prefill, the rest draft/verify)
          │                              per request: Delivery(tokens, finish, stats)
    handle.next() ◄── call_soon_threadsafe ◄──┘  (one callback per step per event loop)
    handle.cancel() ──► aborts ──────►  engine.abort(req): KV freed before the next step

The pending queue is a FairQueue (serving/tenancy.py): one FIFO per tenant (API key), the next request from the
tenant furthest below its weighted share of tokens, a full queue making room for a tenant with a shorter one (the
newest request of the longest is refused: 429).

A request is admitted only when its worst-case KV need (prompt + max_new_tokens + one tree) fits
next to the worst-case needs of the requests already running, so a step never runs out of slots.
With the engine's prefix cache, a request needs no room of its own for the prompt tokens it takes from
the cache, and the cache's tokens no running request uses are room (the engine evicts them when it
needs slots): what is not available is what the admitted requests may still need, plus the cached
tokens they use (locked).

Faults: one request's fault (while admitting it, in one of its engine stages, or delivering its
tokens) fails that request alone, with an error naming the stage, counted in
moa_request_faults_total{reason}. A fault no request can be blamed for (the batched forward) fails
every request the engine holds (reason "step") and the engine restarts clean (`Engine.reset`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from sglang_ext.sampling import InvalidRequest, SamplingParams

from .engine import Engine, Request, StepEvent
from .tenancy import DEFAULT_TENANT, FairQueue, Refused, Tenant, pushed_out

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheUsage:
    """Target KV cache slots (one per token): holding tokens requests use now (their own, and the cached
    prefixes they hit), reserved by admitted requests (each reserves prompt + max_tokens + one draft tree,
    less the prompt tokens it took from the prefix cache, so admission never runs out mid-request; the cached
    tokens they use included), the total, and the tokens in the prefix cache (those no request uses are room:
    not `used`, not `reserved`)."""

    used: int
    reserved: int
    capacity: int
    cached: int = 0


class QueueFull(Exception):
    """The admission queue is full for this request's tenant (or its tokens per minute are spent); retry after
    `retry_after` seconds."""

    def __init__(self, retry_after: int, message: str | None = None):
        super().__init__(message or f"the server is at capacity; retry after {retry_after} s")
        self.retry_after = retry_after


class EngineLoopClosed(Exception):
    """The engine loop stopped (shutdown) and takes no new requests."""


@dataclass
class Delivery:
    """What one engine step did for one request, as seen by the event loop."""

    tokens: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | "rejected" (pushed out of the queue)
    verify_steps: int = 0  # totals so far
    draft_tokens: int = 0
    accepted_tokens: int = 0
    error: str | None = None  # the request failed: internal error, or `invalid` input the engine refused
    invalid: bool = False
    logprobs: list | None = None  # TokenLogprobs of `tokens`, when the request asked for them
    prompt_logprobs: list | None = None  # TokenLogprobs of prompt tokens 1.., with the first token, when asked
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache (not prefilled)
    retry_after: int | None = None  # "rejected": seconds (Retry-After)


class Handle:
    """One request's asyncio side. Created by `EngineLoop.submit`, read with `await next()`."""

    def __init__(
        self,
        engine_loop: EngineLoop,
        prompt_ids: list[int],
        params: SamplingParams,
        loop: asyncio.AbstractEventLoop,
        grammar: object | None = None,
        tenant: str = "",
        owner: Tenant = DEFAULT_TENANT,
    ):
        self.engine_loop, self.prompt_ids, self.params, self.loop = engine_loop, prompt_ids, params, loop
        self.grammar = grammar  # params.grammar compiled (the engine thread never compiles one)
        self.tenant = tenant  # the prefix cache's namespace (engine.add_request)
        self.owner = owner  # the API key's tenant: its place in the fair queue
        self.reservation = len(prompt_ids) + params.max_new_tokens  # KV slots, one tree excluded
        self.cached = 0  # of those, tokens whose slots are the prefix cache's (set on the engine thread)
        self.req: Request | None = None  # engine thread only
        self.done = False  # a final delivery was queued (set on the engine thread)
        self.cancelled = False
        self._last_verify = 0  # engine thread only
        self._queue: asyncio.Queue[Delivery] = asyncio.Queue()

    async def next(self) -> Delivery:
        return await self._queue.get()

    def cancel(self) -> None:
        """Abort (idempotent; a no-op once finished). Safe from any thread."""
        self.engine_loop.abort(self)


class EngineLoop:
    def __init__(self, engine: Engine, *, max_running: int = 64, max_queue: int = 256, telemetry=None):
        if max_running < 1 or max_queue < 0:
            raise ValueError("max_running must be >= 1 and max_queue >= 0")
        self.engine, self.max_running, self.max_queue, self.telemetry = engine, max_running, max_queue, telemetry
        self._cond = threading.Condition()  # guards everything below except _by_rid
        self._pending: FairQueue[Handle] = FairQueue(telemetry.tenants if telemetry else None)  # not admitted yet
        self._aborts: list[Handle] = []
        self._flushes: list[Future] = []  # prefix cache flushes asked for, run on the engine thread between steps
        self._active: set[Handle] = set()  # admitted (taken from pending), not finished
        self._closing = False
        self._by_rid: dict[int, Handle] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None

    # --- any thread -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="moa-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is left and join the engine thread."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closing

    def load(self) -> tuple[int, int]:
        """(running, queued)."""
        with self._cond:
            return len(self._active), len(self._pending)

    def kv_cache(self) -> KVCacheUsage:
        """Read at each /metrics scrape (not per engine step: nothing else reads it)."""
        kv, cache = self.engine.kv, self.engine.prefix_cache
        with self._cond:
            reserved = self._reserved()
        evictable, cached = (cache.evictable, cache.tokens) if cache is not None else (0, 0)
        used = kv.num_slots - 1 - kv.num_free - evictable
        return KVCacheUsage(used=used, reserved=reserved, capacity=kv.num_slots - 1, cached=cached)

    def capacity(self) -> int:
        """The most tokens (prompt + max_new_tokens) one request may reserve in the KV pool."""
        return self.engine.kv.num_slots - 1 - self._tree_nodes()

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        loop: asyncio.AbstractEventLoop | None = None,
        grammar: object | None = None,
        tenant: str = "",
        owner: Tenant = DEFAULT_TENANT,
    ) -> Handle:
        """Queue a request (thread-safe); grammar: params.grammar compiled, required with one (a compile in
        the engine thread would hold every running request up); tenant: its prefix cache namespace; owner: its
        API key's tenant (fair admission). Raises QueueFull, EngineLoopClosed, InvalidRequest (too big for the KV
        pool, or for its tenant's tokens per minute)."""
        if (params.grammar is None) != (grammar is None):
            raise ValueError("a request with a grammar is submitted with its compiled form, and only then")
        h = Handle(self, list(prompt_ids), params, loop or asyncio.get_running_loop(), grammar, tenant, owner)
        if h.reservation > self.capacity():
            raise InvalidRequest(
                f"prompt + max_tokens = {h.reservation} tokens exceeds this server's KV capacity of {self.capacity()} "
                "tokens",
                "max_tokens",
            )
        with self._cond:
            if self._closing or self._thread is None or not self._thread.is_alive():
                raise EngineLoopClosed("the engine is not running")
            # pending may hold max_queue requests beyond the free running slots
            limit = self.max_queue + max(0, self.max_running - len(self._active))
            try:
                out = self._pending.push(h, owner, h.reservation, limit)
            except Refused as e:
                if e.reason == "too_large":
                    raise InvalidRequest(str(e), "max_tokens") from e
                raise QueueFull(e.retry_after or 1, str(e)) from e
            self._cond.notify()
            retry = self._pending.retry_after()
        # pushed out to make room for a tenant with a shorter queue (a 429 as if refused on arrival)
        self._post(
            [self._finish(o, Delivery([], "rejected", error=str(pushed_out(retry)), retry_after=retry)) for o in out]
        )
        return h

    def abort(self, h: Handle) -> None:
        """Abort one request (idempotent; a no-op once finished). Thread-safe."""
        with self._cond:
            if h.done or h.cancelled:
                return
            h.cancelled = True
            if self._pending.remove(h):  # never reached the engine
                self._post([self._finish(h, Delivery([], "abort"))])
                return
            self._aborts.append(h)
            self._cond.notify()

    def flush_cache(self) -> Future:
        """Empty the engine's prefix cache, on the engine thread between steps (thread-safe): the Future's result
        is the engine's CacheFlush (running requests keep what they use until they end)."""
        done: Future = Future()
        with self._cond:
            if self._closing or self._thread is None or not self._thread.is_alive():
                done.set_exception(EngineLoopClosed("the engine is not running"))
                return done
            self._flushes.append(done)
            self._cond.notify()
        return done

    def abort_all(self) -> None:
        with self._cond:
            handles = list(self._pending) + list(self._active)
        for h in handles:
            self.abort(h)

    # --- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._pending or self._aborts or self._flushes or self._active or self._closing):
                    self._cond.wait()
                if self._closing:
                    break
                aborts, self._aborts = self._aborts, []
                flushes, self._flushes = self._flushes, []
            admit: list[Handle] = []
            try:
                # NOTE: aborts (which hand tokens to the prefix cache, evicting past its cap) and flushes change
                # what a queued request would hit: both go before the admission that counts on its hit
                self._apply_aborts(aborts)
                self._flush(flushes)
                with self._cond:
                    admit = self._take_admissible()
                self._iterate(admit, bool(aborts or flushes))
            except Exception:  # noqa: BLE001 - the engine thread must survive anything
                self.last_error = traceback.format_exc()
                n = len(self._by_rid)
                log.error(
                    "engine step fault no request can be blamed for; failing %d requests:\n%s", n, self.last_error
                )
                self._fail_all("internal error in the engine thread", admit)
                self._reset_engine()
            if self.telemetry:
                self.telemetry.occupancy(*self.load())
        self._shutdown()

    def _iterate(self, admit: list[Handle], acted: bool) -> None:
        self._admit(admit)
        if self.engine.has_work:
            self._step()
        elif not (admit or acted):
            time.sleep(0.005)  # pending requests wait for KV reservations to free: do not spin

    def _flush(self, flushes: list[Future]) -> None:
        for done in flushes:
            try:
                done.set_result(self.engine.flush_cache())
            except Exception as e:  # noqa: BLE001 - the caller hears of it; the engine thread carries on
                done.set_exception(e)

    def _tree_nodes(self) -> int:
        return self.engine.tree.num_draft_tokens + 1

    def _reserved(self) -> int:
        """KV slots the admitted requests may need at most, the cached prefixes they use included (lock held)."""
        nodes = self._tree_nodes()
        cache = self.engine.prefix_cache
        return sum(h.reservation - h.cached + nodes for h in self._active) + (cache.locked if cache else 0)

    def _take_admissible(self) -> list[Handle]:
        """Pop pending requests (the fair queue's next) while the running limit and the KV reservations allow
        (lock held; engine thread: it reads the prefix cache). A request that does not fit stops admission: the
        ones after it wait too, so a long request is not passed over for ever.

        A request's worst case is reservation + one tree: at its last verify it holds prompt + outputs
        and the slots of the tree being verified. A prefix cache hit of m tokens, u of them used by no running
        request, needs m fewer of its own and takes u from the evictable room. (Requests admitted together that
        hit the same unused prefix each count it: never too little room.)
        """
        free = self.engine.kv.num_slots - 1 - self._reserved()
        out = []
        while (h := self._pending.peek(self.max_running)) is not None:
            need = self._need(h)
            if need > free:
                break
            self._pending.pop(h)
            free -= need
            self._active.add(h)
            out.append(h)
        return out

    def _need(self, h: Handle) -> int:
        """The KV room admitting a request takes now (engine thread): _take_admissible."""
        hit, unlocked = self.engine.cached_prefix(h.prompt_ids, h.params, h.tenant)
        return h.reservation - hit + unlocked + self._tree_nodes()

    def _admit(self, handles: list[Handle]) -> None:
        posts = []
        for h in handles:
            try:
                h.req = self.engine.add_request(h.prompt_ids, h.params, h.grammar, h.tenant, h.owner.name)
            except InvalidRequest as e:
                posts.append(self._finish(h, Delivery([], error=str(e), invalid=True)))
                continue
            except Exception:  # noqa: BLE001 - this request's fault alone
                log.exception("admitting a request failed; the other requests carry on")
                posts.append(self._fault(h, "prepare"))
                continue
            self._by_rid[h.req.rid] = h
            h.cached = h.req.shared  # (read under the lock by the metrics thread's _reserved: one int)
            if self.telemetry:
                self.telemetry.prompt_tokens.inc(len(h.prompt_ids))
        self._post(posts)

    def _apply_aborts(self, handles: list[Handle]) -> None:
        posts = []
        for h in handles:
            if h.done:
                continue
            if h.req is not None:
                self.engine.abort(h.req)
                self._by_rid.pop(h.req.rid, None)
            posts.append(self._finish(h, Delivery([], "abort")))
        self._post(posts)

    def _step(self) -> None:
        t0 = time.perf_counter()
        events = self.engine.step()  # an exception fails every request (_run), the thread keeps serving
        dt = time.perf_counter() - t0
        for h in self._by_rid.values():  # prompt tokens the prefix cache took from a request need no room of its own
            h.cached = h.req.shared
        posts, tokens = [], 0
        for e in events:
            h = self._by_rid.get(e.request.rid)
            tokens += len(e.new_tokens)
            self._record(h, e)
            if h is None or h.done:
                continue
            try:
                posts.append(self._deliver(h, e))
            except Exception:  # noqa: BLE001 - this request's fault alone: end it, free its KV
                log.exception("delivering a step's tokens failed; the other requests carry on")
                self.engine.abort(e.request)
                self._by_rid.pop(e.request.rid, None)
                posts.append(self._fault(h, "scheduler"))
        if self.telemetry:
            self.telemetry.batch_size.observe(len(events))
            self.telemetry.throughput(len(events), tokens, dt)
        self._post(posts)

    def _deliver(self, h: Handle, e: StepEvent) -> tuple[Handle, Delivery]:
        """One request's share of a step, for its event loop (a final one when the request finished)."""
        r = e.request
        if r.finish_reason == "error":
            del self._by_rid[r.rid]
            return self._fault(h, r.error or "engine")
        st = r.stats
        d = Delivery(
            list(e.new_tokens),
            r.finish_reason,
            st.verify_steps,
            st.draft_tokens,
            st.accepted_tokens,
            logprobs=e.logprobs,
            prompt_logprobs=e.prompt_logprobs,
            cached_tokens=r.cached_tokens,
        )
        if not r.finished:
            return h, d
        del self._by_rid[r.rid]
        return self._finish(h, d)

    def _fault(self, h: Handle, reason: str) -> tuple[Handle, Delivery]:
        """Fail one request after an internal fault in stage `reason` (counted by reason)."""
        if self.telemetry:
            self.telemetry.fault(reason)
        return self._finish(h, Delivery([], "error", error=fault_message(reason)))

    def _reset_engine(self) -> None:
        """After a step fault: the engine drops what is left and its KV pool is whole again."""
        try:
            self.engine.reset()
        except Exception:  # noqa: BLE001 - the engine thread must survive anything
            log.exception("resetting the engine after a step fault failed")

    def _record(self, h: Handle | None, e: StepEvent) -> None:
        if not self.telemetry:
            return
        self.telemetry.generated_tokens.inc(len(e.new_tokens))
        r = e.request
        if self.engine.prefix_cache is not None and e.new_tokens and len(r.output_ids) == len(e.new_tokens):
            # its first token: the prompt was looked up when its prefill started (what usage reports)
            self.telemetry.prefix_cache(len(r.prompt_ids), r.cached_tokens)
        if h is not None and e.request.stats.verify_steps > h._last_verify:
            h._last_verify = e.request.stats.verify_steps
            self.telemetry.verify_step(e.drafted, e.accepted)

    def _finish(self, h: Handle, d: Delivery) -> tuple[Handle, Delivery]:
        with self._cond:
            h.done = True
            self._active.discard(h)
            self._pending.done(h, len(h.prompt_ids), len(h.req.output_ids) if h.req is not None else 0)
        return h, d

    def _fail_all(self, message: str, admitting: Sequence[Handle] = ()) -> None:
        """Fail every request the engine holds (and those being admitted); free their KV."""
        posts = []
        for h in {*self._by_rid.values(), *admitting}:
            if h.done:
                continue
            try:
                if h.req is not None:
                    self.engine.abort(h.req)
            except Exception:  # noqa: BLE001 - the engine is already in trouble; free what we can
                log.exception("abort after an engine error")
            if self.telemetry:
                self.telemetry.fault("step")
            posts.append(self._finish(h, Delivery([], "error", error=message)))
        self._by_rid.clear()
        self._post(posts)

    def _shutdown(self) -> None:
        with self._cond:
            left = list(self._pending) + list(self._active)
            self._pending.clear()
            flushes, self._flushes = self._flushes, []
        for done in flushes:
            done.set_exception(EngineLoopClosed("the engine stopped"))
        for h in left:
            if h.req is not None:
                self.engine.abort(h.req)
        self._by_rid.clear()
        self._post([self._finish(h, Delivery([], "abort")) for h in left if not h.done])

    @staticmethod
    def _post(posts: list[tuple[Handle, Delivery]]) -> None:
        """Hand deliveries to their event loops: one thread-safe callback per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for h, d in posts:
            by_loop.setdefault(h.loop, []).append((h, d))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_dispatch, items)
            except RuntimeError:  # the loop is closed (server exiting): nobody is listening
                pass


def fault_message(reason: str) -> str:
    """What a client reads when an internal fault in stage `reason` ended its request (details: the log)."""
    return f"internal error ({reason}) ended this request; the server's other requests were not affected"


def _dispatch(items: list[tuple[Handle, Delivery]]) -> None:
    for h, d in items:
        h._queue.put_nowait(d)
