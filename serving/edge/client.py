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
from dataclasses import dataclass, field
from typing import Iterator

import httpx
import torch

from sglang_ext.drafters.base import DraftInput
from sglang_ext.drafters.eagle3 import Eagle3Drafter
from sglang_ext.drafters.moa import MoADrafter
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


class EdgeClient:
    def __init__(
        self,
        server: str,
        drafter,
        drafter_name: str,
        shape: TreeShape = TreeShape(1, 2, 3),
        dtype: str = "fp16",
        api_key: str | None = None,
        timeout_s: float = 2.0,
        resync: str = "verify",
        backoff_s: tuple[float, float] = (0.25, 4.0),
        eos_ids: tuple[int, ...] = (),
    ):
        if not isinstance(drafter, (MoADrafter, Eagle3Drafter)):
            raise TypeError("edge clients run a MoA or EAGLE-3 drafter")
        if isinstance(drafter, MoADrafter) and not drafter.remote:
            raise ValueError("build the MoA drafter with remote=True (its TLI layers keep their own K/V)")
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
        pos = torch.arange(start, start + len(tokens))
        if isinstance(self.drafter, Eagle3Drafter):
            self.drafter.ingest_remote(rid, ctx["features"])
        else:
            self.drafter.ingest_remote(rid, tokens, pos, ctx["ca_k"], ctx["ca_v"], ctx.get("tli_k"), ctx.get("tli_v"))

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
        body = {"prompt_token_ids": prompt_ids, "drafter": self.drafter_name, "dtype": self.dtype}
        for attempt in range(3):  # nothing to draft from before the prefill: a few quick retries, then give up
            try:
                head, ctx = self._post("/v1/edge/sessions", body)
                self.stats.setup_bytes += self.stats.cycle_bytes.pop()  # the prompt's context: not a cycle
                break
            except httpx.TransportError:
                if attempt == 2:
                    raise
                time.sleep(self.backoff_s[0] * 2**attempt)
        sid = head["session_id"]
        self._ingest(rid, prompt_ids, 0, ctx)
        verified, root = list(prompt_ids), head["root"]
        out = [root]
        yield Event("token", [root])
        offline: list[int] = []
        next_try, delay = 0.0, self.backoff_s[0]
        params = SamplingParams(max_new_tokens=max_new_tokens)
        try:
            give_up = None
            while True:
                budget_left = len(out) + len(offline) < max_new_tokens and not any(
                    t in self.eos_ids for t in out[:1] + offline
                )
                if not offline and not budget_left:
                    break
                if offline and not budget_left:  # done drafting: only the resync is left
                    give_up = give_up or time.monotonic() + final_sync_s
                    if time.monotonic() > give_up:
                        break
                if not offline:
                    tree = self.drafter.propose([DraftInput(rid, verified + [root], params, None)], self.shape)[0]
                    body = {
                        "seq_len": len(verified),
                        "tokens": tree.draft_tokens.tolist(),
                        "parents": tree.parents.tolist(),
                        "mode": "tree",
                    }
                    try:
                        head, ctx = self._post(f"/v1/edge/sessions/{sid}/verify", body)
                    except httpx.TransportError:
                        self.stats.disconnects += 1
                        next_try, delay = time.monotonic() + self.backoff_s[0], self.backoff_s[0]
                        if not self.can_draft_offline:  # EAGLE-3 needs the target's features for every token
                            head, ctx = self._retry_until_connected(f"/v1/edge/sessions/{sid}/verify", body)
                        else:
                            offline = [self.drafter_offline(rid, verified + [root])]
                            yield Event("draft", offline[-1:])
                            continue
                    kept = [tree.draft_tokens[i].item() for i in head["accepted"]]
                    self._ingest(rid, kept, len(verified), ctx)
                    self.stats.cycles += 1
                    self.stats.accepted += len(head["tokens"]) - 1
                    verified += kept
                    root = head["root"]
                    new, stop = self._clip(head["tokens"], max_new_tokens - len(out))
                    out += new
                    yield Event("token", new)
                    if stop:
                        break
                    continue
                # offline: draft one more token, and now and then try to resync
                if time.monotonic() >= next_try:
                    body = {
                        "seq_len": len(verified),
                        "tokens": [root] + offline,
                        "parents": list(range(-1, len(offline))),
                        "mode": "keep" if self.resync == "keep" else "sync",
                    }
                    try:
                        head, ctx = self._post(f"/v1/edge/sessions/{sid}/verify", body)
                    except httpx.TransportError:
                        next_try, delay = time.monotonic() + delay, min(2 * delay, self.backoff_s[1])
                    else:
                        kept_nodes = head["accepted"]
                        good = len(kept_nodes) - 1  # offline tokens kept
                        self.stats.offline_kept += good
                        kept = [root] + offline[:good]
                        self._ingest(rid, kept, len(verified), ctx)
                        verified += kept
                        root = head["root"]
                        yield Event("confirm", count=good)
                        if good < len(offline):
                            yield Event("retract", count=len(offline) - good)
                        out += offline[:good]
                        offline = []
                        new, stop = self._clip([root], max_new_tokens - len(out))
                        out += new
                        yield Event("token", new)
                        if stop or any(t in self.eos_ids for t in out):
                            break
                        continue
                if len(offline) >= max_offline_tokens or not budget_left:
                    time.sleep(
                        max(0.0, min(next_try - time.monotonic(), 0.5))
                    )  # nothing more to draft; wait for the link
                    continue
                offline.append(self.drafter_offline(rid, verified + [root] + offline))
                yield Event("draft", offline[-1:])
        finally:
            self.drafter.remove_request(rid)
            try:
                self.http.delete(f"/v1/edge/sessions/{sid}", timeout=min(self.timeout_s, 1.0))
            except httpx.HTTPError:
                pass  # the server drops it after its TTL

    @property
    def can_draft_offline(self) -> bool:
        return isinstance(self.drafter, MoADrafter)

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
    if isinstance(d, MoADrafter):
        d = MoADrafter(target.model, d.draft, name=d.name, remote=True)
    return d


def unsupported_settings(params: SamplingParams) -> list[str]:
    """The SamplingParams fields an edge generation cannot honour (empty: it can). The server
    verifies greedily (service.py: greedy_verify) and the client stops at EOS and the token budget
    only, so sampling, penalties, min_tokens and structured output would be silently dropped."""
    defaults = SamplingParams()
    out = [] if params.greedy else ["temperature"]
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "grammar"):
        if getattr(params, name) != getattr(defaults, name):
            out.append(name)
    return out
