"""Tenants and fair admission: whose a request is, and which waiting request runs next.

Tenants come from the API-keys file (gateway/auth.py reads it). A line is a key, then optional fields:

    # key            fields (all optional)
    sk-team-a-1      tenant=team-a weight=2 max_running=16 max_queued=32 tokens_per_minute=200000
    sk-team-a-2      tenant=team-a
    sk-batch         tenant=batch weight=0.5
    sk-3f9c...       # a plain key: its own tenant, weight 1, named key<N> by its place among the keys

Keys with the same `tenant=` share it (its fields may be given on any of its lines, never two different values).
Tenant names are metric labels; keys never are (nor anything derived from them).

FairQueue: the requests waiting for the engine (or the upstream), one FIFO per tenant.

    push(item, tenant, cost, limit)   queued; when the queue holds `limit`, the newest request of the tenant with
                                      the longest queue for its weight is pushed out (429) to make room for a tenant
                                      whose queue is shorter; otherwise the arrival is refused (Refused -> 429)
    peek(max_running) / pop(item)     the next request to admit: from the tenant that has received the least
                                      service for its weight (start-time fair queueing by tokens: each tenant's
                                      virtual time advances by cost / weight per admitted request; a tenant that
                                      starts waiting starts at the current virtual time, so idle time banks nothing)
    done(item, prompt, completion)    an admitted request ended: its running slot is free, its cost settled to
                                      the tokens it used

Guaranteed share: while `max_running` requests run, a tenant running fewer than its share of them
(max_running x weight / the weights of the tenants with requests queued or running, rounded down) is still
admitted: running requests are never preempted, so this is how a newcomer gets a slot without waiting for a
flooding tenant's requests to end. The running count then exceeds max_running until those end (never beyond
2 x max_running); no tenant at or over its share is admitted until it is back under.

Pure bookkeeping (no engine, no I/O but a debug log of each admission event): the caller holds its own lock
(the embedded scheduler's) or runs on one event loop (AsyncAdmission).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import re
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

log = logging.getLogger(__name__)

WINDOW_S = 60.0  # tokens_per_minute counts the tokens of the requests admitted to the queue in the last minute
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_FIELD_NAME = re.compile(r"[a-z_]{1,24}")


@dataclass(frozen=True)
class Tenant:
    """Who a request belongs to (its API key's tenant) and that tenant's share and limits (None: no limit)."""

    name: str
    weight: float = 1.0
    max_running: int | None = None  # requests admitted (running) at once
    max_queued: int | None = None  # requests waiting at once
    tokens_per_minute: int | None = None  # prompt + max_tokens of the requests queued in the last minute


DEFAULT_TENANT = Tenant("default")  # every request when no API keys are configured


class TenantsFileError(ValueError):
    """A line of the API-keys file that cannot be used; the message names the line, never the key."""


# field -> (parse, check, what it must be)
_FIELDS: dict[str, tuple[Callable[[str], object], Callable[[object], bool], str]] = {
    "weight": (float, lambda v: math.isfinite(v) and v > 0, "a number > 0"),
    "max_running": (int, lambda v: v >= 1, "a whole number >= 1"),
    "max_queued": (int, lambda v: v >= 0, "a whole number >= 0"),
    "tokens_per_minute": (int, lambda v: v >= 1, "a whole number >= 1"),
}


def parse_keys(lines: list[str], source: str, prefix: str = "key", unit: str = "line") -> list[tuple[str, Tenant]]:
    """(key, tenant) for each key line (from a word starting with '#' on, a line is a comment). An unnamed key is
    the tenant `<prefix><N>` (N: its place among the keys). Raises TenantsFileError naming `source` and the line
    (or the `unit` its entries are)."""
    entries: list[tuple[str, str]] = []  # key, tenant name
    fields: dict[str, dict] = {}  # tenant name -> its fields
    first: dict[tuple[str, str], int] = {}  # (tenant, field) -> the line that gave it
    seen: dict[str, int] = {}  # key -> line
    named: dict[str, int] = {}  # tenant name -> the first line naming it (tenant=); unnamed: its key's line
    unnamed: dict[str, int] = {}
    for number, raw in enumerate(lines, 1):
        words = raw.split()
        words = words[: next((i for i, w in enumerate(words) if w.startswith("#")), len(words))]  # '#': a comment
        if not words:
            continue
        where = f"{source} {unit} {number}"
        key, given = words[0], _fields(words[1:], where)
        if key in seen:
            raise TenantsFileError(f"{where}: the same key as {unit} {seen[key]}")
        seen[key] = number
        name = given.pop("tenant", None)
        if name is None:
            name = f"{prefix}{len(entries) + 1}"
            unnamed[name] = number
        else:
            named.setdefault(name, number)
        clash = unnamed.get(name) if name in named else None
        if clash is not None:
            raise TenantsFileError(
                f"{source} {unit} {max(clash, named[name])}: tenant name {name!r} is also the name of the unnamed key "
                f"on {unit} {clash}; rename the tenant"
            )
        mine = fields.setdefault(name, {})
        for k, v in given.items():
            if k in mine and mine[k] != v:
                raise TenantsFileError(
                    f"{where}: tenant {name!r} has {k}={v} here and {k}={mine[k]} on {unit} {first[name, k]}"
                )
            mine[k] = v
            first.setdefault((name, k), number)
        entries.append((key, name))
    tenants = {name: Tenant(name, **f) for name, f in fields.items()}
    return [(key, tenants[name]) for key, name in entries]


def _fields(words: list[str], where: str) -> dict:
    out: dict = {}
    for i, word in enumerate(words, 2):
        name, eq, value = word.partition("=")
        # NOTE: a word is named by its place, and a field by its name only when it looks like one: a line holding
        # two keys, or a key with a space, must not put a key into the error (which is logged)
        what = repr(name) if _FIELD_NAME.fullmatch(name) else f"word {i}"
        if not eq:
            raise TenantsFileError(f"{where}: word {i} is not name=value (fields: tenant, {', '.join(_FIELDS)})")
        if name in out:
            raise TenantsFileError(f"{where}: {what} is given twice")
        if name == "tenant":
            if not _NAME.fullmatch(value):
                raise TenantsFileError(
                    f"{where}: tenant name {value!r} must be 1-64 letters, digits, '_', '.' or '-' (a metric label)"
                )
            out[name] = value
            continue
        if name not in _FIELDS:
            raise TenantsFileError(f"{where}: unknown field {what} (fields: tenant, {', '.join(_FIELDS)})")
        parse, ok, must = _FIELDS[name]
        try:
            v = parse(value)
        except ValueError:
            v = None
        if v is None or not ok(v):
            raise TenantsFileError(f"{where}: {name} must be {must}, got {value!r}")
        out[name] = v
    return out


class Refused(Exception):
    """A request not queued: `reason` "queue" (its tenant's share of a full queue, or its max_queued) or
    "tokens_per_minute" (retry after `retry_after` s; None: the caller's estimate), or "too_large" (its cost
    alone exceeds its tenant's tokens_per_minute: no retry can help)."""

    def __init__(self, reason: str, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.reason, self.retry_after = reason, retry_after


def pushed_out(retry_after: int) -> Refused:
    """What a request pushed out of the queue (push's return) is told."""
    return Refused(
        "queue",
        "the server is busy and requests of other keys took this one's place in the queue (this key had more than "
        f"its share queued); retry after {retry_after} s",
        retry_after,
    )


class Observer(Protocol):
    """Per-tenant accounting (serving/backends/telemetry.py: TenantTelemetry)."""

    def admitted(self, tenant: str, waited_s: float) -> None: ...

    def refused(self, tenant: str, reason: str) -> None: ...

    def finished(self, tenant: str, prompt_tokens: int, completion_tokens: int) -> None: ...


T = TypeVar("T", bound=Hashable)


@dataclass(eq=False)
class _Entry:
    item: object
    tenant: str
    cost: int
    seq: int
    at: float
    charge: list = field(default_factory=list)  # [time, tokens]: this request's part of its tenant's minute


@dataclass(eq=False)
class _TenantState:
    tenant: Tenant
    queue: deque = field(default_factory=deque)  # of _Entry, oldest first
    start: float = 0.0  # virtual start of the head request (while the queue is not empty)
    finish: float = 0.0  # virtual finish of the last admitted request
    running: int = 0
    window: deque = field(default_factory=deque)  # of [time, tokens], oldest first


class FairQueue(Generic[T]):
    def __init__(self, observer: Observer | None = None, clock: Callable[[], float] = time.monotonic):
        self.observer, self.clock = observer, clock
        self._tenants: dict[str, _TenantState] = {}
        self._queued: dict[T, _Entry] = {}
        self._running: dict[T, _Entry] = {}
        self._vtime = 0.0  # virtual start of the last admitted request
        self._seq = itertools.count(1)
        self._done_at: deque[float] = deque(maxlen=256)  # when admitted requests ended (Retry-After)

    # --- what is there ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._queued)

    def __contains__(self, item: object) -> bool:
        return item in self._queued

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._queued))

    @property
    def running(self) -> int:
        return len(self._running)

    def counts(self, name: str) -> tuple[int, int]:
        """(running, queued) of one tenant."""
        st = self._tenants.get(name)
        return (st.running, len(st.queue)) if st else (0, 0)

    # --- arrivals ---------------------------------------------------------------------------------
    def push(self, item: T, tenant: Tenant, cost: int, limit: int) -> list[T]:
        """Queue `item` (cost: the tokens it may use, prompt + max_tokens) while the queue holds fewer than
        `limit`; at the limit, push out the newest request of the tenant with the longest queue for its weight,
        when that is longer than this tenant's would be. Returns the items pushed out (each gets a 429).
        Raises Refused."""
        st = self._state(tenant)
        now = self.clock()
        try:
            self._check_tokens(st, cost, now)
            if tenant.max_queued is not None and len(st.queue) >= tenant.max_queued:
                raise self._busy(f"this key has {len(st.queue)} requests queued, its limit")
            out = []
            if len(self._queued) >= limit:
                victim = self._longest_other(st)
                if victim is None:
                    share = " and this key has its share of the queue" if len(st.queue) < len(self._queued) else ""
                    raise self._busy(f"the server is busy ({len(self._queued)} requests queued){share}")
                out.append(self._push_out(victim))
        except Refused as e:
            self._note("refused", tenant.name, 0, e.reason)
            if self.observer:
                self.observer.refused(tenant.name, e.reason)
            self._forget_if_idle(st)
            raise
        e = _Entry(item, tenant.name, cost, next(self._seq), now, [now, cost])
        if not st.queue:
            st.start = max(st.finish, self._vtime)  # a tenant that starts waiting banks no idle time
        st.queue.append(e)
        st.window.append(e.charge)
        self._queued[item] = e
        self._note("queued", tenant.name, e.seq)
        return out

    def _busy(self, why: str) -> Refused:
        retry = self.retry_after()
        return Refused("queue", f"{why}; retry after {retry} s", retry)

    def _state(self, tenant: Tenant) -> _TenantState:
        st = self._tenants.get(tenant.name)
        if st is None:
            st = self._tenants[tenant.name] = _TenantState(tenant, finish=self._vtime)
        st.tenant = tenant  # (the keys file may have changed its weight or limits since)
        return st

    def _check_tokens(self, st: _TenantState, cost: int, now: float) -> None:
        tpm = st.tenant.tokens_per_minute
        if tpm is None:
            return
        if cost > tpm:
            raise Refused(
                "too_large",
                f"this request may use {cost} tokens (prompt + max_tokens), more than this key's limit of {tpm} "
                "tokens per minute; lower max_tokens",
            )
        w = st.window
        while w and w[0][0] <= now - WINDOW_S:
            w.popleft()
        used = sum(tokens for _, tokens in w)
        if used + cost <= tpm:
            return
        freed, leaves = 0, now
        for at, tokens in w:  # the oldest leave the minute first
            freed, leaves = freed + tokens, at + WINDOW_S
            if used - freed + cost <= tpm:
                break
        retry = max(1, math.ceil(leaves - now))
        raise Refused(
            "tokens_per_minute",
            f"this key used {used} of its {tpm} tokens per minute (prompt + max_tokens of its requests); this "
            f"request may use {cost}; retry after {retry} s",
            retry,
        )

    def _longest_other(self, st: _TenantState) -> _TenantState | None:
        """The tenant with the most queued requests for its weight, if that is more than `st` would have with one
        more (compared as cross products: no rounding)."""
        best = None
        for other in self._tenants.values():
            if other is st or not other.queue:
                continue
            if best is None or len(other.queue) * best.tenant.weight > len(best.queue) * other.tenant.weight:
                best = other
        if best is None or (len(st.queue) + 1) * best.tenant.weight >= len(best.queue) * st.tenant.weight:
            return None
        return best

    def _push_out(self, st: _TenantState) -> T:
        e = st.queue.pop()
        del self._queued[e.item]
        e.charge[1] = 0  # it used nothing
        self._note("pushed out", e.tenant, e.seq, "queue")
        if self.observer:
            self.observer.refused(e.tenant, "queue")
        return e.item

    # --- admission --------------------------------------------------------------------------------
    def peek(self, max_running: int) -> T | None:
        """The next request to admit while `max_running` may run (None: none may now; see the module doc)."""
        e = self._next(max_running)
        return None if e is None else e.item

    def _next(self, max_running: int) -> _Entry | None:
        full = len(self._running) >= max_running
        if len(self._running) >= 2 * max_running:  # shares are recomputed as tenants come and go: a hard bound
            return None
        if full:
            active = [s for s in self._tenants.values() if s.queue or s.running]
            weights = sum(s.tenant.weight for s in active)
        best, best_key = None, None
        for st in self._tenants.values():
            if not st.queue:
                continue
            t = st.tenant
            if t.max_running is not None and st.running >= t.max_running:
                continue
            if full and st.running >= math.floor(max_running * t.weight / weights):
                continue
            # least service first; on a tie the tenant running fewer, then the older request
            key = (max(st.start, self._vtime), st.running, st.queue[0].seq)
            if best_key is None or key < best_key:
                best, best_key = st, key
        return None if best is None else best.queue[0]

    def pop(self, item: T) -> None:
        """Admit `item`, the request peek() returned: its tenant's virtual time advances by cost / weight."""
        e = self._queued[item]
        st = self._tenants[e.tenant]
        if st.queue[0] is not e:
            raise ValueError("pop() takes the request peek() returned")
        del self._queued[item]
        st.queue.popleft()
        start = max(st.start, self._vtime)
        self._vtime = start
        st.finish = st.start = start + e.cost / st.tenant.weight
        st.running += 1
        self._running[item] = e
        waited = self.clock() - e.at
        self._note("admitted", e.tenant, e.seq, f"{waited:.3f} s")
        if self.observer:
            self.observer.admitted(e.tenant, waited)

    def done(self, item: T, prompt_tokens: int | None = None, completion_tokens: int = 0) -> None:
        """An admitted request ended (a no-op for one that never was): its slot is free; with the tokens it
        used (prompt_tokens None: unknown), its tenant is charged those instead of its cost."""
        e = self._running.pop(item, None)
        if e is None:
            return
        st = self._tenants[e.tenant]
        st.running -= 1
        self._done_at.append(self.clock())
        if prompt_tokens is not None:
            used = prompt_tokens + completion_tokens
            back = (e.cost - used) / st.tenant.weight
            st.finish -= back
            if st.queue:
                st.start -= back
            e.charge[1] = used
            if self.observer:
                self.observer.finished(e.tenant, prompt_tokens, completion_tokens)
        self._forget_if_idle(st)

    def remove(self, item: T) -> bool:
        """Take a queued request out (its client left); False when it is not queued."""
        e = self._queued.pop(item, None)
        if e is None:
            return False
        st = self._tenants[e.tenant]
        st.queue.remove(e)
        e.charge[1] = 0
        self._note("removed", e.tenant, e.seq)
        self._forget_if_idle(st)
        return True

    def clear(self) -> list[T]:
        """Take every queued request out (shutdown); returns them."""
        items = list(self._queued)
        for item in items:
            self.remove(item)
        return items

    def retry_after(self) -> int:
        """Seconds until a queue slot is likely free: queued requests / recent completion rate (1 to 60)."""
        now = self.clock()
        recent = [t for t in self._done_at if t > now - 60]
        if len(recent) < 2:
            return 1
        rate = len(recent) / max(now - recent[0], 1e-3)
        return max(1, min(60, math.ceil(len(self._queued) / rate)))

    def _forget_if_idle(self, st: _TenantState) -> None:
        """A tenant with nothing queued or running, no minute to remember and no service ahead of the virtual
        time is dropped (what it would start from again): state stays bounded by the tenants in use."""
        w = st.window
        now = self.clock()
        while w and w[0][0] <= now - WINDOW_S:
            w.popleft()
        if not (st.queue or st.running or w) and st.finish <= self._vtime:
            self._tenants.pop(st.tenant.name, None)

    @staticmethod
    def _note(event: str, tenant: str, seq: int, detail: object = "") -> None:
        """A debug log line per admission event; `record.admission` = (event, tenant, seq) for tests and tools."""
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s #%d tenant=%s %s", event, seq, tenant, detail, extra={"admission": (event, tenant, seq)})


class AsyncAdmission:
    """A FairQueue in front of `max_running` slots on one event loop (the sglang backend's upstream requests).

    ticket = await admission.enter(tenant, cost)   # waits for a slot; raises Refused (429) or CancelledError
    try: ... finally: admission.leave(ticket, prompt_tokens, completion_tokens)
    """

    def __init__(
        self, max_running: int, max_queue: int, observer: Observer | None = None, clock=time.monotonic
    ) -> None:
        if max_running < 1 or max_queue < 0:
            raise ValueError("max_running must be >= 1 and max_queue >= 0")
        self.max_running, self.max_queue = max_running, max_queue
        self.queue: FairQueue[_Ticket] = FairQueue(observer, clock)

    def load(self) -> tuple[int, int]:
        """(running, queued)."""
        return self.queue.running, len(self.queue)

    async def enter(self, tenant: Tenant, cost: int) -> _Ticket:
        ticket = _Ticket(asyncio.get_running_loop().create_future())
        limit = self.max_queue + max(0, self.max_running - self.queue.running)
        for out in self.queue.push(ticket, tenant, cost, limit):
            out.future.set_exception(pushed_out(self.queue.retry_after()))
        self._dispatch()
        try:
            await ticket.future
        except BaseException:
            if not self.queue.remove(ticket):  # admitted as its waiter was cancelled: give the slot back
                self.leave(ticket)
            raise
        return ticket

    def leave(self, ticket: _Ticket, prompt_tokens: int | None = None, completion_tokens: int = 0) -> None:
        self.queue.done(ticket, prompt_tokens, completion_tokens)
        self._dispatch()

    def abort_waiting(self, error: Callable[[], BaseException]) -> None:
        """Fail every waiting request with an error(), each its own (the drain deadline)."""
        for ticket in self.queue.clear():
            ticket.future.set_exception(error())

    def _dispatch(self) -> None:
        while (ticket := self.queue.peek(self.max_running)) is not None:
            self.queue.pop(ticket)
            ticket.future.set_result(None)


@dataclass(eq=False)
class _Ticket:
    future: asyncio.Future


__all__ = [
    "DEFAULT_TENANT",
    "AsyncAdmission",
    "FairQueue",
    "Refused",
    "Tenant",
    "TenantsFileError",
    "parse_keys",
    "pushed_out",
]
