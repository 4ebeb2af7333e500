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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

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

    @property
    def seq_len(self) -> int:
        """Tokens whose K/V the target holds (all but the root)."""
        return len(self.token_ids) - 1


@runtime_checkable
class Drafter(Protocol):
    name: str
    capture_layers: tuple[int, ...]  # target layers whose outputs the drafter needs in TargetCapture

    def add_request(self, rid: int, capture: TargetCapture) -> None: ...

    def propose(self, batch: list[DraftInput], shape: TreeShape) -> list[TokenTree]: ...

    def commit(self, rid: int, capture: TargetCapture) -> None: ...

    def remove_request(self, rid: int) -> None: ...
