"""Server side of edge decoding: one session per client generation.

A session holds the verified prefix's K/V in the service's own KV pool (a KVManager, as the engine's, without
a prefix cache) and the root (the last token the target produced, not yet run through it). Each call is one
target forward on a ModelRunner, as the engine's steps are, and greedy verification is the engine's
(verify.greedy_path, then to_host):

    create(prompt)              prefill -> root; context of the prompt tokens
    verify(seq_len, tree)       forward root + draft nodes on the cached prefix; greedy accept;
                                keep the K/V of root + accepted nodes -> tokens (accepted + bonus),
                                context of the kept tokens
    verify(..., mode="sync")    a chain the client generated offline, verified (resync policy "verify")
    verify(..., mode="keep")    such a chain kept as is (resync policy "keep")

"Context" is exactly what the client's drafter needs for the kept tokens (Drafter.edge_context): MoA -> CA
keys/values (2*n_kv*D per token: smaller than the LSA output H, far smaller than all layers' K/V) plus, for
TLI=N, the target's K/V of the last N layers; EAGLE-3 -> fused features fc(low|mid|high) (H).

Exactly-once: a client whose response was lost resends from its own seq_len; the session keeps
the state before its last call, so a request one step behind rolls that call back and redoes it.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field

import torch

from sglang_ext.attention import causal_mask, prefix_and_tree_mask
from sglang_ext.drafters import Drafter, require_drafter
from sglang_ext.models.kv_pool import OutOfSlots
from sglang_ext.tree import tree_from_parents
from sglang_ext.verify import greedy_path, to_host

from ..kv_manager import KVManager
from ..model_runner import ModelRunner
from .protocol import DTYPES


class EdgeError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


@dataclass(frozen=True)
class EdgeLimits:
    ttl_s: float = 120.0  # idle sessions are dropped (and their KV freed) after this
    max_sessions: int = 64
    max_session_tokens: int = 4096  # per-session memory bound (KV slots)
    max_tree_nodes: int = 64
    max_sync_tokens: int = 512  # longest offline chain a resync may send
    kv_slots: int = 65536


@dataclass
class Session:
    id: str
    drafter: str
    dtype: str
    slots: torch.Tensor  # KV slots of the verified tokens, in order
    tokens: list[int]  # verified tokens
    root: int
    last_used: float
    prev: tuple[int, int] | None = None  # (seq_len, root) before the last verify, for one-step rollback
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def seq_len(self) -> int:
        return len(self.tokens)


class EdgeService:
    def __init__(self, target, drafters: dict[str, Drafter], limits: EdgeLimits | None = None):
        """drafters: name -> a drafter for `target` with an edge context (Drafter.edge: MoA, EAGLE-3); the server
        computes their context."""
        for name, d in drafters.items():
            if d is None or not require_drafter(d).edge:
                raise ValueError(f"edge drafter {name!r}: only MoA and EAGLE-3 drafters have a client-side context")
        self.target, self.model = target, target.model
        self.drafters = drafters
        self.limits = limits or EdgeLimits()
        self.kv_manager = KVManager(self.model, self.limits.kv_slots)
        capture = tuple(sorted({l for d in drafters.values() for l in d.capture_layers}))
        self.runner = ModelRunner(self.model, self.kv_manager, capture)
        self.sessions: dict[str, Session] = {}
        self._forward_lock = threading.Lock()  # one forward at a time on this pool
        self._table_lock = threading.Lock()
        self.eos_ids = set(self.model.cfg.eos_token_ids)

    @property
    def kv(self):
        """The service's KV pool."""
        return self.kv_manager.pool

    # --- sessions -----------------------------------------------------------------------------
    def create(self, prompt_ids: list[int], drafter: str, dtype: str = "fp16") -> tuple[dict, dict[str, torch.Tensor]]:
        if drafter not in self.drafters:
            raise EdgeError(
                400,
                f"unknown edge drafter {drafter!r}; this server offers {sorted(self.drafters)}",
                "invalid_value",
                "drafter",
            )
        if dtype not in DTYPES:
            raise EdgeError(400, f"dtype must be one of {sorted(DTYPES)}", "invalid_value", "dtype")
        self._check_ids(prompt_ids, "prompt_token_ids")
        if not prompt_ids:
            raise EdgeError(400, "prompt_token_ids is empty", "invalid_value", "prompt_token_ids")
        if len(prompt_ids) + 1 > self.limits.max_session_tokens:
            raise EdgeError(
                400,
                f"prompt has {len(prompt_ids)} tokens; a session holds at most {self.limits.max_session_tokens}",
                "context_length_exceeded",
                "prompt_token_ids",
            )
        self.reap()
        with self._table_lock:
            if len(self.sessions) >= self.limits.max_sessions:
                raise EdgeError(
                    429, f"too many edge sessions ({self.limits.max_sessions}); retry later", "rate_limit_exceeded"
                )
            sess = Session(
                secrets.token_urlsafe(16), drafter, dtype, torch.empty(0, dtype=torch.long), [], -1, time.monotonic()
            )
            self.sessions[sess.id] = sess
        try:
            with sess.lock, self._forward_lock:
                n = len(prompt_ids)
                slots = self._alloc(n)
                pos = torch.arange(n)
                none = torch.empty(0, dtype=torch.long)
                out = self.runner.forward_rows([torch.tensor(prompt_ids)], [pos], [slots], [none], [causal_mask(n, 0)])
                sess.slots, sess.tokens = slots, list(prompt_ids)
                sess.root = int(self.runner.logits(out.hidden[-1:], fp32=True).argmax(-1)[0])
                ctx = self._context(sess, slots, pos, out.captured, torch.arange(n))
        except BaseException:
            self.close(sess.id)
            raise
        return {
            "session_id": sess.id,
            "root": sess.root,
            "seq_len": sess.seq_len,
            "ttl_s": self.limits.ttl_s,
            "drafter": drafter,
        }, ctx

    def verify(
        self, sid: str, seq_len: int, tokens: list[int], parents: list[int], mode: str = "tree"
    ) -> tuple[dict, dict[str, torch.Tensor]]:
        sess = self._get(sid)
        with sess.lock:
            self._sync_to(sess, seq_len)
            n = len(tokens)
            if mode not in ("tree", "sync", "keep"):
                raise EdgeError(400, "mode must be 'tree', 'sync' or 'keep'", "invalid_value", "mode")
            limit = self.limits.max_tree_nodes if mode == "tree" else self.limits.max_sync_tokens + 1
            if not 1 <= n <= limit:
                raise EdgeError(400, f"tree has {n} nodes; 1..{limit} allowed", "invalid_value", "tokens")
            if len(parents) != n:
                raise EdgeError(400, f"parents has {len(parents)} entries for {n} tokens", "invalid_value", "parents")
            self._check_ids(tokens, "tokens")
            if tokens[0] != sess.root:
                raise EdgeError(
                    409, f"tokens[0] must be the session's root token {sess.root}", "session_out_of_sync", "tokens"
                )
            if mode != "tree" and parents != list(range(-1, n - 1)):
                raise EdgeError(
                    400, f"mode {mode!r} takes a chain (parents = [-1, 0, 1, ...])", "invalid_value", "parents"
                )
            if sess.seq_len + n + 1 > self.limits.max_session_tokens:
                raise EdgeError(
                    400, f"session would exceed {self.limits.max_session_tokens} tokens", "context_length_exceeded"
                )
            try:
                tree = tree_from_parents(torch.tensor(tokens), torch.tensor(parents), sess.seq_len)
            except ValueError as e:
                raise EdgeError(400, f"malformed tree: {e}", "invalid_value", "parents") from e
            with self._forward_lock:
                new = self._alloc(n)
                try:
                    mask = prefix_and_tree_mask(tree.tree_mask, sess.seq_len)
                    out = self.runner.forward_rows([tree.draft_tokens], [tree.positions], [new], [sess.slots], [mask])
                    argmax = self.runner.logits(out.hidden, fp32=True).argmax(-1)
                    if mode == "keep":
                        nodes, res_tokens = list(range(n)), tokens[1:] + [int(argmax[-1])]
                    else:
                        res = to_host([greedy_path(tree, argmax)])[0]
                        nodes, res_tokens = res.accepted_nodes, res.tokens
                    keep = new[nodes]
                    rejected = torch.ones(n, dtype=torch.bool)
                    rejected[nodes] = False
                    self.kv_manager.free(new[rejected])
                except BaseException:
                    self.kv_manager.free(new)
                    raise
                sess.prev = (sess.seq_len, sess.root)
                sess.slots = torch.cat([sess.slots, keep])
                sess.tokens += [tokens[i] for i in nodes]
                sess.root = res_tokens[-1]
                ctx = self._context(sess, keep, tree.positions[nodes], out.captured, torch.tensor(nodes))
            sess.last_used = time.monotonic()
            return {"accepted": nodes, "tokens": res_tokens, "root": sess.root, "seq_len": sess.seq_len}, ctx

    def close(self, sid: str) -> bool:
        with self._table_lock:
            sess = self.sessions.pop(sid, None)
        if sess is None:
            return False
        with sess.lock:
            self.kv_manager.free(sess.slots)
            sess.slots = torch.empty(0, dtype=torch.long)
        return True

    def reap(self, now: float | None = None) -> int:
        """Drop sessions idle longer than the TTL; returns how many."""
        now = time.monotonic() if now is None else now
        with self._table_lock:
            expired = [
                s.id for s in self.sessions.values() if now - s.last_used > self.limits.ttl_s and not s.lock.locked()
            ]
        return sum(self.close(sid) for sid in expired)

    # --- internals ----------------------------------------------------------------------------
    def _get(self, sid: str) -> Session:
        self.reap()
        sess = self.sessions.get(sid)
        if sess is None:
            raise EdgeError(
                404,
                f"no edge session {sid!r} (unknown, closed or expired after {self.limits.ttl_s:.0f}s idle)",
                "session_not_found",
            )
        sess.last_used = time.monotonic()
        return sess

    def _sync_to(self, sess: Session, seq_len: int) -> None:
        """Bring the session to the client's seq_len: equal -> nothing; one call behind -> roll it back."""
        if seq_len == sess.seq_len:
            return
        if sess.prev is not None and seq_len == sess.prev[0]:
            self.kv_manager.free(sess.slots[seq_len:])
            sess.slots, sess.tokens, sess.root = sess.slots[:seq_len], sess.tokens[:seq_len], sess.prev[1]
            sess.prev = None
            return
        raise EdgeError(
            409,
            f"client is at {seq_len} verified tokens, the session at {sess.seq_len}",
            "session_out_of_sync",
            "seq_len",
        )

    def _alloc(self, n: int) -> torch.Tensor:
        try:
            return self.kv_manager.alloc(n)
        except OutOfSlots as e:
            raise EdgeError(429, f"edge KV pool is full ({e}); retry later", "rate_limit_exceeded") from e

    def _check_ids(self, ids: list[int], param: str) -> None:
        vocab = self.model.cfg.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise EdgeError(400, f"{param} must be token ids in [0, {vocab})", "invalid_value", param)

    @torch.inference_mode()
    def _context(
        self, sess: Session, slots: torch.Tensor, positions: torch.Tensor, captured: dict, rows: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        hidden = {l: h[rows] for l, h in captured.items()}
        return self.drafters[sess.drafter].edge_context(self.kv, slots, positions, hidden)
