"""The MoA draft math of the SGLang worker, free of SGLang objects (runs on CPU in tests).

Two operations, the same as the embedded drafter's commit/propose (sglang_ext/drafters/moa.py)
but over slot-indexed pools instead of per-request slot lists:

    moa_commit   verified tokens at `slots`: LSA over their K/V at every target layer -> CA K/V,
                 and SA K/V of their embeddings; both written to the draft pools at the same slots
                 (the draft pool shares SGLang's slot numbers, so freeing is the target's business)
    moa_draft    EAGLE-2 tree search from each request's root (the bonus token): every pass runs
                 SA (prefix SA K/V + the node itself, or its ancestors), CA (prefix memory), and the
                 target's last N layers (prefix target K/V + the node's ancestors, written to the
                 request's draft block, which verify overwrites afterwards).
                 Returns SGLang's (parent_list, top_scores_index, draft_tokens) in target ids.

The caller supplies the draft model (MoADraft or the SGLang MoADraftModel: same piece API), the
target's embedding / lm_head rows / final norm, TLI layer callables and a tree-attention function
fn(q, k_pool, v_pool, plan, scale).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..attention.plan import AttentionPlan
from ..models.moa import stack_layer_kv
from ..tree import TreeSearch
from .layout import draft_block, draft_columns, next_visibility, only_self, step_columns, tree_step_plan

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionPlan, float], torch.Tensor]
# (x [n, H], positions [n], node slots [n], plan) -> x; writes the layer's K/V of the nodes at the slots
TLILayer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionPlan], torch.Tensor]

LSA_CHUNK = 1024  # verified tokens per LSA call: [chunk, L, W] stays small for long prefills


@dataclass
class MoAPools:
    """K/V buffers [num_slots, heads, head_dim], all indexed by SGLang slot numbers."""

    sa_k: torch.Tensor
    sa_v: torch.Tensor
    ca_k: torch.Tensor
    ca_v: torch.Tensor
    target_k: Sequence[torch.Tensor]  # every target layer (LSA input)
    target_v: Sequence[torch.Tensor]


@torch.inference_mode()
def moa_commit(
    draft, embed: torch.Tensor, pools: MoAPools, slots: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor
) -> None:
    for a in range(0, slots.numel(), LSA_CHUNK):
        s, pos, tok = slots[a : a + LSA_CHUNK], positions[a : a + LSA_CHUNK], token_ids[a : a + LSA_CHUNK]
        memory = draft.lsa(stack_layer_kv(pools.target_k, pools.target_v, s))
        k, v = draft.ca_kv(memory, pos)
        pools.ca_k[s], pools.ca_v[s] = k.to(pools.ca_k.dtype), v.to(pools.ca_v.dtype)
        _, k, v = draft.sa_qkv(embed[tok], pos)
        pools.sa_k[s], pools.sa_v[s] = k.to(pools.sa_k.dtype), v.to(pools.sa_v.dtype)


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
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    roots: torch.Tensor,  # [bs] target ids
    topk: int,
    num_steps: int,
    num_draft_tokens: int,
    sa_tree_attention: str = "self",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    bs = seq_lens.numel()
    width = draft_columns(num_steps, topk)
    block = draft_block(req_to_token, req_pool_indices, seq_lens, width)
    ca_plan = None

    def run(tokens: torch.Tensor, step: int, visible: torch.Tensor) -> torch.Tensor:
        """One pass over the frontier tokens [bs, kk] (target ids) -> draft logits [bs, kk, Vd]."""
        nonlocal ca_plan
        kk = tokens.shape[1]
        cols = step_columns(step, topk, seq_lens.device)
        used = int(cols.max()) + 1
        node_slots = block[:, cols].reshape(-1)
        positions = (seq_lens.long()[:, None] + step).expand(bs, kk).reshape(-1)
        x = embed[tokens.reshape(-1)]
        q, k, v = draft.sa_qkv(x, positions)
        pools.sa_k[node_slots], pools.sa_v[node_slots] = k.to(pools.sa_k.dtype), v.to(pools.sa_v.dtype)
        sa_visible = visible if sa_tree_attention == "ancestors" else only_self(cols, width, bs)
        sa_plan = tree_step_plan(req_to_token, req_pool_indices, seq_lens, block[:, :used], sa_visible[:, :, :used], kk)
        x1 = draft.sa_finish(attention(q, pools.sa_k, pools.sa_v, sa_plan, draft.scale), x)
        if ca_plan is None or ca_plan.qo_indptr.numel() - 1 != bs or int(ca_plan.qo_indptr[1]) != kk:
            ca_plan = tree_step_plan(req_to_token, req_pool_indices, seq_lens, None, None, kk)
        x2 = draft.ca_finish(attention(draft.ca_q(x1, positions), pools.ca_k, pools.ca_v, ca_plan, draft.scale), x1)
        if tli_layers:
            tli_plan = tree_step_plan(
                req_to_token, req_pool_indices, seq_lens, block[:, :used], visible[:, :, :used], kk
            )
            for layer in tli_layers:
                x2 = layer(x2, positions, node_slots, tli_plan)
        logits = torch.nn.functional.linear(final_norm(x2), head).float()
        return logits.view(bs, kk, -1)

    visible = next_visibility(None, None, step_columns(0, topk, seq_lens.device), width, bs)
    root_logits = run(roots.long()[:, None], 0, visible)[:, 0]
    topk_p, topk_index = torch.softmax(root_logits, dim=-1).topk(topk, dim=-1)
    search = TreeSearch.start(topk)
    tokens, scores = search.first(topk_p, hot_ids[topk_index])
    parent_beam = None
    for step in range(1, num_steps):
        visible = next_visibility(visible, parent_beam, step_columns(step, topk, seq_lens.device), width, bs)
        logits = run(tokens, step, visible)
        child_p, child_index = torch.softmax(logits, dim=-1).topk(topk, dim=-1)
        tokens, scores, parent_beam = search.expand(
            step, scores, child_p.flatten(0, 1), hot_ids[child_index].flatten(0, 1)
        )
    return search.organize(num_draft_tokens)


__all__ = ["LSA_CHUNK", "MoAPools", "moa_commit", "moa_draft"]
