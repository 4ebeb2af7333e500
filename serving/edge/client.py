"""Edge client: drafts locally, calls the server once per draft–verify cycle, keeps generating
when the network is gone.

    client = EdgeClient("http://server:8000", local_drafter)        # a MoA / EAGLE-3 drafter, remote=True
    for ev in client.generate(prompt_ids, max_new_tokens=128):
        ...  # Event("token", ids) verified | Event("draft", ids) unverified | Event("confirm", n) | Event("retract", n)

Connected: one POST per cycle with the tree (tokens + parent indices); the response carries the
accepted path, the bonus token and the drafter context of the kept tokens.
Disconnected (timeout or connection error): the drafter continues alone (TLI>0 runs its own copy
of the target's last N layers), emitting unverified tokens; it retries with exponential backoff
and on reconnect re-synchronises the server with the offline tokens, either verifying them
("verify", default: kept up to the first disagreement, the rest retracted and replaced by the
target's token) or keeping them as they are ("keep").
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field

import httpx
import torch

from sglang_ext.drafters.base import Drafter, DrafterError, DraftInput, require_drafter
from sglang_ext.sampling import SamplingParams
from sglang_ext.tree import TreeShape

from .protocol import MEDIA_TYPE, unpack


class EdgeServerError(RuntimeError):
    """The server answered with an error (4xx/5xx): a bug or bad input, not a network problem."""

    def __init__(self, status: int, body: str):
        super().__init__(f"edge server error {status}: {body}")
        self.status = status


@dataclass
class Event:
    kind: str  # "token" | "draft" | "confirm" | "retract"
    tokens: list[int] = field(default_factory=list)
    count: int = 0


@dataclass
class EdgeStats:
    cycles: int = 0  # successful verify calls
    drafted: int = 0  # draft tokens those calls carried (tree nodes, roots excluded)
    calls: int = 0  # HTTP requests attempted (create, verify, resync, failures)
    bytes_up: int = 0
    bytes_down: int = 0
    accepted: int = 0  # draft tokens accepted over all cycles
    offline_tokens: int = 0  # tokens drafted while disconnected
    offline_kept: int = 0  # of those, kept after resync
    disconnects: int = 0
    cycle_bytes: list[int] = field(default_factory=list)  # request + response bytes of each verify call
    setup_bytes: int = 0  # session creation (the prompt's context)

    @property
    def accept_length(self) -> float:
        return (self.accepted + self.cycles) / self.cycles if self.cycles else 0.0


@dataclass
class _Generation:
    """One generate() call: the session and the tokens so far."""

    rid: int
    sid: str
    params: SamplingParams
    max_new_tokens: int
    verified: list[int]  # the context the server holds (prompt + verified tokens, without root)
    root: int  # the latest verified token, not yet in the server's context
    out: list[int]  # verified output tokens
    offline: list[int] = field(default_factory=list)  # drafted while disconnected, not yet verified
    next_try: float = 0.0  # monotonic time of the next resync attempt
    delay: float = 0.0  # current resync backoff


class EdgeClient:
    def __init__(
        self,
        server: str,
        drafter: Drafter,
        drafter_name: str,
        shape: TreeShape = TreeShape(1, 2, 3),
        dtype: str = "fp16",
        api_key: str | None = None,
        timeout_s: float = 2.0,
        resync: str = "verify",
        backoff_s: tuple[float, float] = (0.25, 4.0),
        eos_ids: tuple[int, ...] = (),
    ):
        if drafter is None or not require_drafter(drafter).edge:
            raise TypeError("edge clients run a drafter with an edge context (MoA or EAGLE-3)")
        if not drafter.edge_client_ready:
            raise ValueError(
                "build the drafter for an edge client (drafter.for_edge_client(): MoA with remote=True, its TLI layers "
                "keeping their own K/V)"
            )
        if resync not in ("verify", "keep"):
            raise ValueError("resync must be 'verify' or 'keep'")
        self.drafter, self.drafter_name, self.shape, self.dtype = drafter, drafter_name, shape, dtype
        self.timeout_s, self.resync, self.backoff_s = timeout_s, resync, backoff_s
        self.eos_ids = set(eos_ids)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=server.rstrip("/"), headers=headers, timeout=timeout_s)
        self.stats = EdgeStats()
        self._rid = 0

    def close(self) -> None:
        self.http.close()

    # --- transport ----------------------------------------------------------------------------
    def _post(self, path: str, body: dict) -> tuple[dict, dict]:
        """One call; network trouble raises httpx.TransportError, server errors EdgeServerError."""
        self.stats.calls += 1
        req = self.http.build_request("POST", path, json=body)
        up = len(req.content)
        resp = self.http.send(req)
        self.stats.bytes_up += up
        self.stats.bytes_down += len(resp.content)
        if resp.status_code != 200 or resp.headers.get("content-type", "").split(";")[0] != MEDIA_TYPE:
            raise EdgeServerError(resp.status_code, resp.text[:500])
        self.stats.cycle_bytes.append(up + len(resp.content))
        if body.get("mode") == "tree":  # a draft-verify cycle: the tree's nodes after its root
            self.stats.drafted += len(body["tokens"]) - 1
        return unpack(resp.content)

    def _ingest(self, rid: int, tokens: list[int], start: int, ctx: dict) -> None:
        self.drafter.ingest_context(rid, tokens, torch.arange(start, start + len(tokens)), ctx)

    # --- generation ---------------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int = 128,
        max_offline_tokens: int = 256,
        final_sync_s: float = 30.0,
    ) -> Iterator[Event]:
        """final_sync_s: when the budget is used up while offline, how long to keep trying to get
        the offline tokens verified before returning them unverified."""
        self._rid += 1
        rid = self._rid
        head, ctx = self._open_session(prompt_ids)
        self._ingest(rid, prompt_ids, 0, ctx)
        g = _Generation(
            rid,
            head["session_id"],
            SamplingParams(max_new_tokens=max_new_tokens),
            max_new_tokens,
            verified=list(prompt_ids),
            root=head["root"],
            out=[head["root"]],
            delay=self.backoff_s[0],
        )
        yield Event("token", [g.root])
        try:
            yield from self._run(g, max_offline_tokens, final_sync_s)
        finally:
            self.drafter.remove_request(rid)
            try:
                self.http.delete(f"/v1/edge/sessions/{g.sid}", timeout=min(self.timeout_s, 1.0))
            except httpx.HTTPError:
                pass  # the server drops it after its TTL

    def _open_session(self, prompt_ids: list[int]) -> tuple[dict, dict]:
        """Creates the server session (prefill): nothing to draft from before it, so a few quick retries,
        then the network error."""
        body = {"prompt_token_ids": prompt_ids, "drafter": self.drafter_name, "dtype": self.dtype}
        for attempt in range(3):
            try:
                head, ctx = self._post("/v1/edge/sessions", body)
                break
            except httpx.TransportError:
                if attempt == 2:
                    raise
                time.sleep(self.backoff_s[0] * 2**attempt)
        self.stats.setup_bytes += self.stats.cycle_bytes.pop()  # the prompt's context: not a cycle
        return head, ctx

    def _run(self, g: _Generation, max_offline_tokens: int, final_sync_s: float) -> Iterator[Event]:
        """Draft-verify cycles while connected; offline, drafts alone and now and then tries to resync."""
        give_up = None
        while True:
            budget_left = len(g.out) + len(g.offline) < g.max_new_tokens and not any(
                t in self.eos_ids for t in g.out[:1] + g.offline
            )
            if not g.offline and not budget_left:
                return
            if g.offline and not budget_left:  # done drafting: only the resync is left
                give_up = give_up or time.monotonic() + final_sync_s
                if time.monotonic() > give_up:
                    return
            if not g.offline:
                if (yield from self._cycle(g)):
                    return
                continue
            if time.monotonic() >= g.next_try:
                over = yield from self._resync(g)
                if over is not None:
                    if over:
                        return
                    continue
            if len(g.offline) >= max_offline_tokens or not budget_left:
                # nothing more to draft; wait for the link
                time.sleep(max(0.0, min(g.next_try - time.monotonic(), 0.5)))
                continue
            g.offline.append(self.drafter_offline(g.rid, g.verified + [g.root] + g.offline))
            yield Event("draft", g.offline[-1:])

    def _cycle(self, g: _Generation) -> Generator[Event, None, bool]:
        """One connected draft-verify cycle; returns whether the generation is over. When the call fails,
        a MoA drafter goes offline with one drafted token (EAGLE-3 waits for the link)."""
        tree = self.drafter.propose([DraftInput(g.rid, g.verified + [g.root], g.params, None)], self.shape)[0]
        if tree.finite is not None and not bool(tree.finite):  # (the tree is read here anyway)
            raise DrafterError("drafter produced non-finite logits")
        path = f"/v1/edge/sessions/{g.sid}/verify"
        body = {
            "seq_len": len(g.verified),
            "tokens": tree.draft_tokens.tolist(),
            "parents": tree.parents.tolist(),
            "mode": "tree",
        }
        try:
            head, ctx = self._post(path, body)
        except httpx.TransportError:
            self.stats.disconnects += 1
            g.next_try, g.delay = time.monotonic() + self.backoff_s[0], self.backoff_s[0]
            if self.can_draft_offline:
                g.offline = [self.drafter_offline(g.rid, g.verified + [g.root])]
                yield Event("draft", g.offline[-1:])
                return False
            head, ctx = self._retry_until_connected(path, body)  # EAGLE-3 needs the target's features for every token
        kept = [tree.draft_tokens[i].item() for i in head["accepted"]]
        self._ingest(g.rid, kept, len(g.verified), ctx)
        self.stats.cycles += 1
        self.stats.accepted += len(head["tokens"]) - 1
        g.verified += kept
        g.root = head["root"]
        new, stop = self._clip(head["tokens"], g.max_new_tokens - len(g.out))
        g.out += new
        yield Event("token", new)
        return stop

    def _resync(self, g: _Generation) -> Generator[Event, None, bool | None]:
        """Sends the offline tokens to be verified ("sync") or kept ("keep"). Returns None while the link
        is still down (the next try backs off), else whether the generation is over."""
        body = {
            "seq_len": len(g.verified),
            "tokens": [g.root] + g.offline,
            "parents": list(range(-1, len(g.offline))),
            "mode": "keep" if self.resync == "keep" else "sync",
        }
        try:
            head, ctx = self._post(f"/v1/edge/sessions/{g.sid}/verify", body)
        except httpx.TransportError:
            g.next_try, g.delay = time.monotonic() + g.delay, min(2 * g.delay, self.backoff_s[1])
            return None
        good = len(head["accepted"]) - 1  # offline tokens kept
        self.stats.offline_kept += good
        kept = [g.root] + g.offline[:good]
        self._ingest(g.rid, kept, len(g.verified), ctx)
        g.verified += kept
        g.root = head["root"]
        yield Event("confirm", count=good)
        if good < len(g.offline):
            yield Event("retract", count=len(g.offline) - good)
        g.out += g.offline[:good]
        g.offline = []
        new, stop = self._clip([g.root], g.max_new_tokens - len(g.out))
        g.out += new
        yield Event("token", new)
        return stop or any(t in self.eos_ids for t in g.out)

    @property
    def can_draft_offline(self) -> bool:
        return self.drafter.drafts_offline

    def drafter_offline(self, rid: int, token_ids: list[int]) -> int:
        self.stats.offline_tokens += 1
        return self.drafter.offline_next(rid, token_ids)

    def _retry_until_connected(self, path: str, body: dict) -> tuple[dict, dict]:
        delay = self.backoff_s[0]
        while True:
            time.sleep(delay)
            try:
                return self._post(path, body)
            except httpx.TransportError:
                delay = min(2 * delay, self.backoff_s[1])

    def _clip(self, tokens: list[int], room: int) -> tuple[list[int], bool]:
        """Cut at the first EOS and at the token budget; -> (tokens, generation is over)."""
        for i, t in enumerate(tokens):
            if t in self.eos_ids:
                return tokens[: min(i + 1, room)], True
        return tokens[:room], len(tokens) >= room


def collect(events: Iterator[Event]) -> tuple[list[int], list[int]]:
    """Run a generation; -> (verified tokens, trailing unverified tokens)."""
    verified, pending = [], []
    for ev in events:
        if ev.kind == "token":
            verified += ev.tokens
        elif ev.kind == "draft":
            pending += ev.tokens
        elif ev.kind == "confirm":
            verified += pending[: ev.count]
            pending = pending[ev.count :]
        elif ev.kind == "retract":
            pending = pending[: len(pending) - ev.count]
    return verified, pending


def local_drafter(target, name: str):
    """The client's drafter for a registry name or checkpoint: a MoA drafter keeps its own copy of
    the TLI layers' K/V (remote=True); an EAGLE-3 drafter as it is."""
    from sglang_ext.drafters import make_drafter

    d = make_drafter(name, target)
    return d.for_edge_client() if d is not None else None


def unsupported_settings(params: SamplingParams) -> list[str]:
    """The SamplingParams fields an edge generation cannot honour (empty: it can). The server
    verifies greedily (service.py: greedy_path) and the client stops at EOS and the token budget
    only, so sampling, penalties, min_tokens and structured output would be silently dropped."""
    defaults = SamplingParams()
    out = [] if params.greedy else ["temperature"]
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "grammar"):
        if getattr(params, name) != getattr(defaults, name):
            out.append(name)
    return out
