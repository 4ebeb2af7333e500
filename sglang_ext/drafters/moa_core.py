"""The MoA draft math: one implementation for the embedded drafter (drafters/moa.py) and the SGLang
plugin's worker (sglang_plugin/draft_core.py). Storage and attention are the caller's.

    lsa_memory / commit_ca / commit_sa
                 verified tokens -> LSA memory (their K/V at every target layer, one LSA pass per
                 token) -> CA keys/values; SA keys/values of their embeddings. The caller stores
                 both (the embedded drafter in its own pools, the plugin at the target's slots).
    draft_pass   one pass over frontier nodes: SA (verified SA K/V + the node itself, or its
                 ancestors), CA (verified memory), the target's last N layers (TLI: verified target
                 K/V + the node's ancestors' speculative K/V), the target's final norm -> hidden.
    draft_logits hidden -> logits over the draft vocab (the target lm_head's draft-vocab rows), or
                 scattered over the target vocab (sampled chains need q over the target vocab).
    draft_tree   the tree-search driver: a pass over the roots, then one pass per search step; the
                 top-k search itself is search.py's (the caller picks search_tree or top_k_search).

Where a pass writes and what each node sees come from the caller's frontier function, called once
per pass: the embedded drafter hands out temporary slots and plans each node's path; the plugin
uses the request's reserved draft block and SGLang's req_to_token rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import torch

from ..attention import AttentionFn
from ..attention.plan import AttentionPlan
from ..device import upload
from ..kernels import linear
from ..models.moa import MoAPieces, stack_layer_kv
from .search import StepFn, scatter_to_vocab

# (x [n, H], positions [n], node slots [n], plan) -> x [n, H]; writes the layer's K/V of the nodes at the slots
TLILayer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionPlan], torch.Tensor]
R = TypeVar("R")


@dataclass
class MoAParts:
    """What a draft pass computes with: the draft model's pieces and the target's own parts."""

    draft: MoAPieces  # MoADraft, or the plugin's MoADraftModel (SGLang layers, same pieces)
    embed: torch.Tensor  # [V, H] the target's embedding
    head: torch.Tensor  # [Vd, H] the target lm_head's draft-vocab rows
    hot_ids: torch.Tensor  # [Vd] draft id -> target id
    final_norm: Callable[[torch.Tensor], torch.Tensor]  # the target's final norm
    tli_layers: Sequence[TLILayer]  # the target's last N layers, in order (empty: TLI 0)
    attention: AttentionFn  # fn(q [n, Hq, D], k_pool, v_pool, plan, scale) -> [n, Hq, D]


@dataclass
class DraftKV:
    """The draft's K/V buffers, each [num_slots, kv_heads, head_dim]."""

    sa_k: torch.Tensor  # SA keys of verified tokens and of the current tree's nodes
    sa_v: torch.Tensor
    ca_k: torch.Tensor  # CA keys of verified tokens (LSA memory)
    ca_v: torch.Tensor


@dataclass
class PassSlots:
    """Where one pass over n frontier nodes writes its K/V and what each node attends to."""

    positions: torch.Tensor  # [n] token positions of the nodes
    sa_slots: torch.Tensor  # [n] where the nodes' SA K/V go in DraftKV.sa_k/sa_v
    tli_slots: torch.Tensor  # [n] where the TLI layers write the nodes' target K/V
    sa_plan: AttentionPlan | None  # per node: verified SA keys + itself (or its ancestors and itself)
    ca_plan: AttentionPlan | None  # per node: the request's verified memory
    tli_plan: AttentionPlan | None  # per node: verified target K/V + its ancestors and itself (None: TLI 0)
    # the same three as plan_frontier's inputs, name -> (per request its verified slots, per node the
    # temporary slots it also reads): what a static (CUDA-graph) pass takes instead of the plans
    specs: dict | None = None


def plan_fields(plans: dict) -> dict:
    """PassSlots' plan fields from plans named as its specs ('sa', 'ca', and 'tli', absent for TLI 0)."""
    return {"sa_plan": plans["sa"], "ca_plan": plans["ca"], "tli_plan": plans.get("tli")}


# a storage's frontier: parent [b, kk] (each new node's parent among the previous pass's nodes;
# zeros for the roots' pass) -> the PassSlots of the next pass
Frontier = Callable[[torch.Tensor], PassSlots]


# --- commit: verified tokens -------------------------------------------------------------------------


def lsa_memory(
    draft: MoAPieces, target_k: Sequence[torch.Tensor], target_v: Sequence[torch.Tensor], slots: torch.Tensor
) -> torch.Tensor:
    """LSA over the verified tokens' K/V at every target layer -> memory [n, H].
    target_k/target_v: the target's per-layer pools [num_slots, n_kv, D]; slots [n]."""
    return draft.lsa(stack_layer_kv(target_k, target_v, slots))


# A request the adaptive policy kept from drafting for a while has its verified tokens queued (commits cost nothing
# then); LSA over all of them at the next draft made each trial of the drafter cost O(tokens since it last drafted,
# its prompt's too when it never drafted: ~1/3 of its prefill), so a drafter that loses kept costing while off. A
# catch-up gives memory to the tokens of the last CATCH_UP_COMMITS commits only (a request's prompt is its first
# commit: whole when it drafts within that many steps of its prefill): CA never sees the older queued tokens (SA and
# the TLI layers still do). Drafts after a long pause may be worse; what is accepted is the target's either way. A
# request that drafts every step has one commit queued at each propose: no holes. Nor does a flush give memory to
# more than a request's last MEMORY_TOKENS queued tokens (a step of a tree up to 7 deep verifies fewer; a deeper
# one's commit runs eagerly): a token's LSA is 30 rows of a layer (~0.4 ms on a CPU core), so a prompt's memory cost
# ~13 ms at 32 tokens, while CA's memory of all but the latest tokens moves few drafts (tau on the six eval sets x 5
# prompts, whose summarisation prompts are 700 tokens: 1.382 with memory for every token, 1.382 for the last 32,
# 1.382 for the last 8, 1.379 for the last 4; 2026-11-29).
CATCH_UP_COMMITS = 8
MEMORY_TOKENS = 8


def catch_up(commits: list[list[int]]) -> tuple[list[tuple[int, int]], torch.Tensor | None]:
    """commits: per request, its queued commits' token counts, oldest first. -> (per request [0, b): its leading
    queued tokens that get no memory (b == 0: none); [m] the rows of every queued token, request after request,
    that do, or None: all)."""
    holes = [(0, max(sum(c[: max(0, len(c) - CATCH_UP_COMMITS)]), sum(c) - MEMORY_TOKENS)) for c in commits]
    if all(b == 0 for _, b in holes):
        return holes, None
    rows, at = [], 0
    for c, (_, b) in zip(commits, holes):
        rows += range(at + b, at + sum(c))
        at += sum(c)
    return holes, torch.tensor(rows, dtype=torch.long)


def commit_ca(draft: MoAPieces, memory: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """memory [n, H] of verified tokens at positions [n] -> CA keys/values [n, kv_heads, D]."""
    return draft.ca_kv(memory, positions)


def commit_sa(
    draft: MoAPieces, embed: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verified token_ids [n] at positions [n] -> SA keys/values [n, kv_heads, D] of their embeddings."""
    _, k, v = draft.sa_qkv(embed[token_ids], positions)
    return k, v


# --- one draft pass ----------------------------------------------------------------------------------


def draft_pass(parts: MoAParts, kv: DraftKV, tokens: torch.Tensor, at: PassSlots) -> torch.Tensor:
    """tokens [n] target ids of the frontier nodes -> hidden [n, H] after the target's final norm.
    Writes the nodes' SA K/V at at.sa_slots and (TLI layers) their target K/V at at.tli_slots."""
    d = parts.draft
    x = parts.embed[tokens]
    # host-built rows go up in one queued copy (an index on the host makes a GPU host wait)
    positions, sa_slots, tli_slots = upload([at.positions, at.sa_slots, at.tli_slots], x.device)
    rope = d.rope(positions, x.dtype)  # one cos/sin for SA and CA, where x is
    q, k, v = d.sa_qkv(x, positions, rope)
    kv.sa_k[sa_slots], kv.sa_v[sa_slots] = k.to(kv.sa_k.dtype), v.to(kv.sa_v.dtype)
    x = d.sa_finish(parts.attention(q, kv.sa_k, kv.sa_v, at.sa_plan, d.scale), x)
    q = d.ca_q(x, positions, rope)
    x = d.ca_finish(parts.attention(q, kv.ca_k, kv.ca_v, at.ca_plan, d.scale), x)
    for layer in parts.tli_layers:
        x = layer(x, positions, tli_slots, at.tli_plan)
    return parts.final_norm(x)


def draft_logits(parts: MoAParts, hidden: torch.Tensor, full: bool = False) -> torch.Tensor:
    """hidden [n, H] -> fp32 logits [n, Vd] over the draft vocab, or [n, V] over the target vocab
    (ids outside the draft vocab never drawn) when full."""
    lg = linear(hidden, parts.head).float()
    return scatter_to_vocab(lg, parts.hot_ids, parts.draft.cfg.vocab_size) if full else lg


# --- the tree-search driver --------------------------------------------------------------------------


def draft_tree(
    parts: MoAParts,
    kv: DraftKV,
    frontier: Frontier,
    roots: torch.Tensor,  # [b] target ids (each request's last verified token)
    search: Callable[[torch.Tensor, StepFn], R],
    full: bool = False,
    logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
    run_pass: Callable[[torch.Tensor, PassSlots], torch.Tensor] | None = None,
) -> R:
    """A pass over the roots (each a node at its own position), then one pass per search step.
    search(root_logits [b, V], step_fn) runs the top-k search (search.py) and returns its result.
    The search sees draft-vocab ids unless full (target-vocab logits: ids are target ids already).
    logits: hidden -> logits of a pass (default draft_logits(parts, hidden, full)).
    run_pass(tokens [n], slots) -> logits [n, V]: a pass run some other way (a replayed CUDA graph)."""
    b = roots.numel()
    to_logits = logits or (lambda h: draft_logits(parts, h, full))

    def run(tokens: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
        """tokens [b, kk] target ids; parent [b, kk] index into the previous pass's nodes -> [b, kk, V]."""
        at, flat = frontier(parent), tokens.reshape(-1)
        lg = run_pass(flat, at) if run_pass is not None else to_logits(draft_pass(parts, kv, flat, at))
        return lg.view(b, tokens.shape[1], -1)

    def step_fn(tokens: torch.Tensor, parent_beam: torch.Tensor | None) -> torch.Tensor:
        parent = torch.zeros_like(tokens) if parent_beam is None else parent_beam
        return run(tokens if full else parts.hot_ids[tokens], parent)

    roots = roots.long()[:, None]
    root_logits = run(roots, torch.zeros_like(roots))[:, 0]
    return search(root_logits, step_fn)


__all__ = [
    "DraftKV",
    "Frontier",
    "MoAParts",
    "PassSlots",
    "TLILayer",
    "commit_ca",
    "commit_sa",
    "draft_logits",
    "draft_pass",
    "draft_tree",
    "lsa_memory",
]
