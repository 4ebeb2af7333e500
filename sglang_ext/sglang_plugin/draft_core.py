"""The SGLang worker's storage for the MoA draft core (drafters/moa_core.py), free of SGLang objects
(runs on CPU in tests). The math is moa_core's, the same the embedded drafter runs; here it works
over slot-indexed pools instead of per-request slot lists:

    moa_commit   verified tokens at `slots`: CA K/V (LSA over their K/V at every target layer) and
                 SA K/V written to the draft pools at the same slots (the draft pool shares SGLang's
                 slot numbers, so freeing is the target's business)
    moa_draft    the core's tree search from each request's root (the bonus token); pass s writes
                 its nodes' SA and TLI K/V to columns step_columns(s) of the request's draft block
                 (verify overwrites them afterwards); each node sees the request's req_to_token
                 prefix and its block columns (layout.py). Returns SGLang's (parent_list,
                 top_scores_index, draft_tokens) in target ids.

The caller supplies the draft model (MoADraft or the SGLang MoADraftModel: same piece API), the
target's embedding / lm_head rows / final norm, TLI layer callables and a tree-attention function
fn(q, k_pool, v_pool, plan, scale).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..attention import AttentionFn
from ..drafters.moa_core import DraftKV, MoAParts, PassSlots, TLILayer, commit_ca, commit_sa, draft_tree, lsa_memory
from ..drafters.search import top_k_search
from .layout import draft_block, draft_columns, next_visibility, only_self, step_columns, tree_step_plan

LSA_CHUNK = 1024  # verified tokens per LSA call: [chunk, L, W] stays small for long prefills


@dataclass
class MoAPools(DraftKV):
    """The draft's K/V buffers [num_slots, heads, head_dim] (DraftKV) and the target's per-layer
    pools (LSA input), all indexed by SGLang slot numbers."""

    target_k: Sequence[torch.Tensor] = ()  # every target layer
    target_v: Sequence[torch.Tensor] = ()


@torch.inference_mode()
def moa_commit(
    draft, embed: torch.Tensor, pools: MoAPools, slots: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor
) -> None:
    """slots / positions / token_ids [n] of the verified tokens."""
    for a in range(0, slots.numel(), LSA_CHUNK):
        s, pos, tok = slots[a : a + LSA_CHUNK], positions[a : a + LSA_CHUNK], token_ids[a : a + LSA_CHUNK]
        k, v = commit_ca(draft, lsa_memory(draft, pools.target_k, pools.target_v, s), pos)
        pools.ca_k[s], pools.ca_v[s] = k.to(pools.ca_k.dtype), v.to(pools.ca_v.dtype)
        k, v = commit_sa(draft, embed, tok, pos)
        pools.sa_k[s], pools.sa_v[s] = k.to(pools.sa_k.dtype), v.to(pools.sa_v.dtype)


class DraftBlock:
    """moa_core's Frontier over SGLang's slots: pass s's nodes take columns step_columns(s) of each
    request's reserved draft block; SA and TLI write at the same slots (the draft and target pools
    share slot numbers)."""

    def __init__(
        self,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        topk: int,
        num_steps: int,
        sa_tree_attention: str,
        tli: bool,
    ):
        self.req_to_token, self.req_pool_indices, self.seq_lens = req_to_token, req_pool_indices, seq_lens
        self.topk, self.sa_tree_attention, self.tli = topk, sa_tree_attention, tli
        self.width = draft_columns(num_steps, topk)
        self.block = draft_block(req_to_token, req_pool_indices, seq_lens, self.width)  # [bs, width]
        self.step = 0
        self.visible: torch.Tensor | None = None  # [bs, kk, width] the last pass's ancestors-and-self columns
        self.ca_plan = None  # the prefix-only plan, kept while the pass size repeats

    def __call__(self, parent: torch.Tensor) -> PassSlots:
        """parent [bs, kk]: each new node's index among the previous pass's nodes."""
        bs, kk = parent.shape
        seq_lens, plan_args = self.seq_lens, (self.req_to_token, self.req_pool_indices, self.seq_lens)
        cols = step_columns(self.step, self.topk, seq_lens.device)
        used = int(cols.max()) + 1
        self.visible = next_visibility(self.visible, parent, cols, self.width, bs)
        block = self.block[:, :used]
        sa_visible = self.visible if self.sa_tree_attention == "ancestors" else only_self(cols, self.width, bs)
        ca_plan = self.ca_plan
        if ca_plan is None or ca_plan.qo_indptr.numel() - 1 != bs or int(ca_plan.qo_indptr[1]) != kk:
            self.ca_plan = ca_plan = tree_step_plan(*plan_args, None, None, kk)
        node_slots = self.block[:, cols].reshape(-1)
        at = PassSlots(
            positions=(seq_lens.long()[:, None] + self.step).expand(bs, kk).reshape(-1),
            sa_slots=node_slots,
            tli_slots=node_slots,
            sa_plan=tree_step_plan(*plan_args, block, sa_visible[:, :, :used], kk),
            ca_plan=ca_plan,
            tli_plan=tree_step_plan(*plan_args, block, self.visible[:, :, :used], kk) if self.tli else None,
        )
        self.step += 1
        return at


@torch.inference_mode()
def moa_draft(
    draft,
    embed: torch.Tensor,  # [V, H] target embedding
    head: torch.Tensor,  # [Vd, H] the target lm_head's draft-vocab rows
    hot_ids: torch.Tensor,  # [Vd] draft id -> target id
    final_norm: Callable[[torch.Tensor], torch.Tensor],
    tli_layers: Sequence[TLILayer],
    pools: MoAPools,
    attention: AttentionFn,
    req_to_token: torch.Tensor,  # [max_reqs, max_context] slot of token i of request r
    req_pool_indices: torch.Tensor,  # [bs]
    seq_lens: torch.Tensor,  # [bs] verified tokens (the root is not one)
    roots: torch.Tensor,  # [bs] target ids
    topk: int,
    num_steps: int,
    num_draft_tokens: int,
    sa_tree_attention: str = "self",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    parts = MoAParts(draft, embed, head, hot_ids, final_norm, tli_layers, attention)
    frontier = DraftBlock(
        req_to_token, req_pool_indices, seq_lens, topk, num_steps, sa_tree_attention, bool(tli_layers)
    )
    search = draft_tree(
        parts,
        pools,
        frontier,
        roots,
        # no finiteness flag: the worker has no fallback to take (SGLang verifies what it is given)
        lambda root_logits, step_fn: top_k_search(root_logits, step_fn, topk, num_steps),
    )
    parent_list, top_scores_index, draft_tokens = search.organize(num_draft_tokens)
    return parent_list, top_scores_index, hot_ids[draft_tokens]


__all__ = ["LSA_CHUNK", "DraftBlock", "MoAPools", "moa_commit", "moa_draft"]
