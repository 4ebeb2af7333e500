"""The one drafter interface every drafter implements (n-gram, draft model, EAGLE-3, MoA).

Lifecycle of a request, as the engine drives it:

    add_request(rid, TargetCapture of the prompt)      after the target's prefill
    loop:
        propose([DraftInput ...], shape, ...)  -> one TokenTree per request (root = last token)
        commit(rid, TargetCapture of root + accepted nodes)   after verification
    remove_request(rid)

A drafter owns only its own state (e.g. its KV cache); the engine owns requests and the target
KV pool. A drafter whose commit() does nothing (it reads token ids only: n-gram, suffix) may say so
with `needs_commit = False`, and the engine skips building the TargetCapture of every verify step. A drafter
that learns from the target's prediction at every node of the verified tree, accepted or not (lookahead's
Jacobi window), says `wants_tree_argmax = True` and gets TargetCapture.tree_argmax; the others pay nothing.
A drafter that reads a verified token's state from the target's KV pool alone (MoA's LSA) says
`catches_up = True`: the engine commits no step whose trees are all roots (speculation off), and the drafter
takes those tokens from DraftInput.token_ids and DraftInput.slots at its next propose; one that needs them says
`commits_roots = True` and gets such a step's commits in one call (commit_roots: a row of the captured layers each).
Trees may differ in size across requests (a drafter with nothing to say returns a
root-only tree, which the engine verifies as a plain decode step). A drafter that searches a request's
predicted output (DraftInput.reference) itself says `reads_reference = True`; for the others the engine
drafts such a request from its prediction where it matches (drafters/prediction.py), and skips the
drafter for it that step, as it does when speculation is off.

Prefix cache. A request whose prompt starts with tokens the engine's prefix cache holds prefills only the rest;
its add_request capture says how many leading tokens came from the cache (`TargetCapture.cached`: their K/V was
computed by an earlier request); its `hidden` has rows for the tokens computed now (from `cached` on), and
`cached_hidden(start)` gives the captured layers' rows of cached tokens [start, cached): the engine keeps them
beside its cache, unless the drafter reads only a request's last token's (`reads_prefix_hidden = False`). A
drafter with state of its own over the prefix either rebuilds it from the capture (the default) or keeps it
beside the target's cache, keyed by the target's slot of each token (drafters/kept.py):

    release_request(rid, taken)  instead of remove_request when the request ends and the cache holds some of its
                                 tokens (taken[i]: the target slot of token i, or -1): keep your state of those
                                 (where none is kept under that slot yet), free the rest
    drop_prefix(slots)           the cache let these target slots go: free what is kept under them
(such a drafter says `keeps_prefix_state = True`).

Capabilities are declared on the drafter type (`Drafter`'s class attributes, overridden by the drafters that
have them), never probed: the engine and the edge code read them as plain attributes, and a drafter that
needs none of them inherits the defaults (as SGLang's BaseSpecWorker gives no-op hooks). Besides those above:
`captures_steps` (its draft steps can replay captured graphs: the engine sets `step_graphs` with a graph
runner), `member_names` and `member_stats()` (a merged drafter's members), `stop_learning()` (a drafter that
learns from served outputs stops), and edge decoding (serving/edge):
`edge` (the server computes a client-side context of verified tokens: `edge_context`, which the client's copy,
`for_edge_client()`, takes in with `ingest_context`) and `drafts_offline` (`offline_next`: the client keeps
drafting while the server is out of reach).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..models.kv_pool import KVPool
from ..sampling import SamplingParams
from ..tree import TokenTree, TreeShape


class DrafterError(RuntimeError):
    """A drafter failed (exception or non-finite output); the engine falls back to vanilla decoding."""


@dataclass
class TargetCapture:
    """What the target computed for tokens it just verified (prefill: the prompt; verify: root + accepted)."""

    token_ids: list[int]
    positions: torch.Tensor  # [a] int64
    slots: torch.Tensor  # [a] int64, the tokens' slots in the target KV pool
    # layer -> [a - cached, H] output of that target layer, for the tokens computed now
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    kv: "KVPool | None" = None  # the target's KV pool (read-only for drafters; MoA reads every layer's K/V at `slots`)
    # verify only, for drafters with `wants_tree_argmax`: the target's argmax (raw logits) at every node of
    # the verified tree, in the TokenTree's node order; host values (the engine copies them with the
    # step's accepted tokens, in its one copy)
    tree_argmax: torch.Tensor | None = None  # [num_nodes] int64
    # add_request only: leading tokens whose K/V came from the engine's prefix cache (computed for an earlier request)
    cached: int = 0
    # cached_hidden(start) -> layer -> [cached - start, H]: the captured layers of cached tokens [start, cached),
    # kept by the engine beside its prefix cache (None when it keeps none)
    cached_hidden: Callable[[int], dict[int, torch.Tensor]] | None = None


@dataclass
class DraftInput:
    rid: int
    token_ids: list[int]  # prompt + generated; the last one is the root (no target K/V yet)
    params: SamplingParams
    generator: torch.Generator | None
    # a predicted output (OpenAI's `prediction`), behind the prompt's last tokens so its start can be
    # matched too; lookup drafters search it, others may ignore it (it never changes the output)
    reference: list[int] = field(default_factory=list)
    # the request's tenant (its API key and cache_salt; "" by default): state learned from one tenant's requests
    # (the suffix drafter's corpus of answers) drafts only that tenant's
    tenant: str = ""
    # [seq_len] int64: the target KV pool's slots of token_ids[:-1] (None where the engine gives none); a drafter that
    # `catches_up` takes the tokens it was not committed from here and from token_ids
    slots: torch.Tensor | None = None

    @property
    def seq_len(self) -> int:
        """Tokens whose K/V the target holds (all but the root)."""
        return len(self.token_ids) - 1


def require_drafter(obj: object) -> "Drafter":
    """obj, when it is a Drafter (the capabilities the engine reads are declared there); else a TypeError naming it."""
    if not isinstance(obj, Drafter):
        raise TypeError(f"{type(obj).__name__} is not a drafter: subclass sglang_ext.drafters.Drafter")
    return obj


class Drafter:
    """The interface: the four lifecycle calls every drafter implements, and the capabilities a drafter declares by
    overriding these class attributes (module docstring); the defaults are a drafter that needs none of them, and
    the optional hooks do nothing or fall back to the lifecycle calls."""

    name: str = ""
    capture_layers: tuple[int, ...] = ()  # target layers whose outputs the drafter needs in TargetCapture
    needs_commit: bool = True  # False: commit() is a no-op (the engine builds no verify-step TargetCapture)
    # True: a step that drafts nothing (every tree its root: speculation off) is not committed; the drafter takes the
    # tokens it missed from DraftInput (token_ids, slots) at its next propose (MoA: their K/V are in the target's pool)
    catches_up: bool = False
    # True: such a step's commits come in one commit_roots call (each request's root: a row of the captured layers)
    commits_roots: bool = False
    wants_tree_argmax: bool = False  # commit's TargetCapture carries the target's argmax at every tree node
    reads_reference: bool = False  # searches DraftInput.reference itself (else the engine drafts from it)
    reads_prefix_hidden: bool = True  # reads the captured layers of prefix-cached tokens (cached_hidden)
    keeps_prefix_state: bool = False  # keeps its state beside the prefix cache (release_request, drop_prefix)
    captures_steps: bool = False  # its draft steps can replay captured graphs (then `step_graphs` turns them on)
    step_graphs: bool = False
    member_names: tuple[str, ...] = ()  # a merged drafter's members (adaptive speculation offers each alone)
    edge: bool = False  # serves edge decoding: edge_context on the server, ingest_context on the client
    edge_client_ready: bool = False  # this object can run on an edge client (for_edge_client() makes one)
    drafts_offline: bool = False  # an edge client's drafter drafts on while the server is out of reach
    # its greedy static step chains in the overlapped loop: drafted from the previous step's accepted path on the
    # device (serving/spec_step.py: use_stream, chain_fits, propose_chained, commit_chained, drop_chained)
    chains: bool = False
    stream = None  # where its graphs go (None: the device's own stream; use_stream)

    def add_request(self, rid: int, capture: TargetCapture) -> None:
        raise NotImplementedError

    def commit_roots(self, rids: list[int], captured: dict[int, torch.Tensor]) -> None:
        """With `commits_roots`: a step whose trees were all roots commits every request's root at once: request
        rids[i]'s is row i of every captured layer ({layer: [>= len(rids), H]}), at its next position and slot."""
        raise NotImplementedError

    def propose(self, batch: list[DraftInput], shape: TreeShape) -> list[TokenTree]:
        raise NotImplementedError

    def commit(self, rid: int, capture: TargetCapture) -> None:
        raise NotImplementedError

    def remove_request(self, rid: int) -> None:
        raise NotImplementedError

    # --- beside the prefix cache (keeps_prefix_state) ------------------------------------------------
    def release_request(self, rid: int, taken: torch.Tensor) -> None:
        """The request ended while the prefix cache holds some of its tokens (taken[i]: token i's target slot, or
        -1): a drafter that keeps no state beside the cache just forgets the request."""
        self.remove_request(rid)

    def drop_prefix(self, slots: torch.Tensor) -> None:
        """The prefix cache let these target slots go: nothing kept under them by default."""

    def stop_learning(self) -> None:
        """Stop learning from served outputs (a benchmark repeats its prompts: a drafter that learned their
        answers would be scored on what it has seen); nothing to stop by default."""

    # --- the overlapped loop's chained steps (chains) -------------------------------------------------------
    def use_stream(self, stream) -> None:
        """Its graphs go on `stream` (the target's, so that they are ordered with the verify's)."""
        raise DrafterError(f"{self.name or type(self).__name__}: does not chain")

    def chain_fits(self, rids: list[int], shape: TreeShape, chained: bool) -> bool:
        """Whether a chained step of these requests (chained: after another, from its futures) replays whole."""
        return False

    def propose_chained(self, batch: list[DraftInput], shape: TreeShape, fut, prev: list[int]) -> list[TokenTree]:
        """The trees of a chained step: its commit of the previous step's accepted path, read on the device from
        `fut` (models/spec_graphs.SpecFuture) at each request's row `prev`, then the search (packed trees)."""
        raise DrafterError(f"{self.name or type(self).__name__}: does not chain")

    def commit_chained(self, rid: int, n: int, slots: torch.Tensor | None = None) -> None:
        """The previous step's path is read: n of the chained step's commit rows were real (slots: their target
        slots); the rest of what it took goes back."""

    def drop_chained(self, rid: int, committed: int = 0) -> None:
        """The request ends before its chained step is read: what that step took goes back, and the last
        `committed` rows committed when the step before it was read."""

    def settle(self, batch: list[DraftInput]) -> None:
        """Requests just started (add_request) while a chain is in flight: their prompt's state processed now, its
        device work issued in order on the stream, so that they can join the chain (`join_chained`); a request it
        cannot settle stays as it was (its next step then ends the chain). Nothing by default."""

    def joins(self, rid: int) -> bool:
        """Whether the request, not in the chained step in flight, can join the next one (`join_chained`)."""
        return False

    def join_chained(self, batch: list[DraftInput], fut, rows: list[int]) -> int:
        """Requests that were in no step of the chain join its next one: what its commit takes of each from the
        futures written at rows `rows` of `fut` (rows no verify wrote), in order on the stream -> L, the commit
        rows that are real for each (commit_chained(rid, L) once the step is issued)."""
        raise DrafterError(f"{self.name or type(self).__name__}: does not chain")

    # --- a merged drafter's members -----------------------------------------------------------------
    def member_stats(self) -> dict:
        """{member: {proposed, accepted, accept_rate}} for a merged drafter; empty for the others."""
        return {}

    # --- edge decoding (serving/edge) ---------------------------------------------------------------
    def edge_context(
        self, kv: KVPool, slots: torch.Tensor, positions: torch.Tensor, hidden: dict[int, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Server side: what the client's drafter needs of newly verified tokens (their target slots in kv,
        positions [n], the captured layers' rows [n, H]), by name, for the wire."""
        raise DrafterError(f"{self.name or type(self).__name__}: no edge context")

    def for_edge_client(self) -> "Drafter":
        """The drafter an edge client runs (the target elsewhere): this one, unless it must be built otherwise."""
        return self

    def ingest_context(self, rid: int, tokens: list[int], positions: torch.Tensor, ctx: dict) -> None:
        """Client side: the server's edge_context of verified tokens `tokens` at `positions`."""
        raise DrafterError(f"{self.name or type(self).__name__}: no edge context")

    def offline_next(self, rid: int, token_ids: list[int]) -> int:
        """Client side, offline (drafts_offline): the next token after token_ids, drafted alone."""
        raise DrafterError(f"{self.name or type(self).__name__}: does not draft offline")
