"""Pure index functions between SGLang's batch tensors and the MoA draft passes (any device).

SGLang's slot bookkeeping that the MoA worker relies on (read from sglang 0.5.23):

    req_to_token[req, i]        the KV slot of token i of request `req` (target and draft pools
                                share slot numbers; the draft pool just has other buffers)
    seq_lens[b]                 tokens whose target K/V exists (the root/bonus token is not one)
    verify window               out_cache_loc.view(bs, N)[b] = req_to_token[req_b, seq_len_b : +N]
    after verify                the accepted path (root first) sits in the window's first
                                accept_lens[b] slots (SGLang moves it there for topk > 1)
    draft block                 req_to_token[req_b, seq_len_b : +max(topk*steps, N)] is reserved
                                for the step; the MoA draft writes its tree nodes' speculative K/V
                                into its first 1 + topk*(steps-1) slots (verify overwrites them)

Draft tree columns of a request's block (root first, then topk nodes per later step):

    step 0:  column 0 (the root)        step i >= 1:  columns 1 + (i-1)*topk ... + topk - 1
"""

from __future__ import annotations

import torch

from ..attention.flashinfer_plan import plan_from_ragged
from ..attention.plan import AttentionPlan

# --- what the target just verified ---------------------------------------------------------------


def committed_after_extend(
    out_cache_loc: torch.Tensor, input_ids: torch.Tensor, prefix_lens: list[int], extend_lens: list[int]
):
    """Prefill (or a prefill chunk): every extended token is verified.

    Returns (slots [n], positions [n], token_ids [n]) in batch order."""
    device = out_cache_loc.device
    lens = torch.as_tensor(extend_lens, device=device)
    starts = torch.as_tensor(prefix_lens, device=device)
    first = torch.repeat_interleave(starts - torch.cat([lens.new_zeros(1), lens.cumsum(0)[:-1]]), lens)
    positions = first + torch.arange(int(lens.sum()), device=device)
    return out_cache_loc.long(), positions.long(), input_ids.long()


def committed_after_verify(
    out_cache_loc: torch.Tensor,
    accept_index: torch.Tensor,
    accept_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    draft_token: torch.Tensor,
    num_draft_tokens: int,
):
    """Decode: the root plus the accepted draft nodes of each request.

    accept_index [bs, S] flat node ids (b*N + i, root first, -1 padded); accept_lens [bs] counts
    the root too. The tokens are the tree's node tokens at those ids; their K/V is in the first
    accept_lens[b] slots of the verify window. Returns (slots, positions, token_ids, batch_index).
    """
    bs, width = accept_index.shape
    device = accept_index.device
    j = torch.arange(width, device=device)[None, :]
    keep = j < accept_lens.long()[:, None]
    window = out_cache_loc.view(bs, num_draft_tokens)
    slots = window[:, :width][keep]
    positions = (seq_lens.long()[:, None] + j)[keep]
    tokens = draft_token.reshape(-1)[accept_index.long().clamp(min=0)][keep]
    batch_index = torch.arange(bs, device=device)[:, None].expand(bs, width)[keep]
    return slots.long(), positions, tokens.long(), batch_index


# --- the draft block -------------------------------------------------------------------------------


def draft_columns(num_steps: int, topk: int) -> int:
    """Slots one request's MoA draft writes: the root and topk nodes for each later step."""
    return 1 + topk * (num_steps - 1)


def step_columns(step: int, topk: int, device=None) -> torch.Tensor:
    if step == 0:
        return torch.zeros(1, dtype=torch.long, device=device)
    return 1 + (step - 1) * topk + torch.arange(topk, dtype=torch.long, device=device)


def draft_block(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, width: int
) -> torch.Tensor:
    """[bs, width] slots req_to_token[req_b, seq_len_b + c] (reserved for this decode step)."""
    cols = seq_lens.long()[:, None] + torch.arange(width, device=seq_lens.device)[None, :]
    return req_to_token[req_pool_indices.long()[:, None], cols].long()


def next_visibility(
    visible: torch.Tensor | None, parent_beam: torch.Tensor | None, cols: torch.Tensor, width: int, bs: int
) -> torch.Tensor:
    """Which draft-block columns each new frontier node sees (its ancestors and itself).

    visible [bs, k_prev, width] of the previous frontier (None before the root); parent_beam
    [bs, k] indexes it (None: every node's parent is frontier node 0, i.e. the root)."""
    k = cols.numel()
    if visible is None:
        out = torch.zeros(bs, k, width, dtype=torch.bool, device=cols.device)
    elif parent_beam is None:
        out = visible[:, :1].expand(bs, k, width).clone()
    else:
        out = torch.gather(visible, 1, parent_beam.long()[:, :, None].expand(bs, k, width)).clone()
    out[:, torch.arange(k, device=cols.device), cols] = True
    return out


def only_self(cols: torch.Tensor, width: int, bs: int) -> torch.Tensor:
    """Visibility of SA in 'self' mode: each node sees only its own column of the block."""
    k = cols.numel()
    out = torch.zeros(bs, k, width, dtype=torch.bool, device=cols.device)
    out[:, torch.arange(k, device=cols.device), cols] = True
    return out


# --- attention plans of one draft step ------------------------------------------------------------


def tree_step_plan(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    block: torch.Tensor | None,
    visible: torch.Tensor | None,
    queries_per_req: int,
) -> AttentionPlan:
    """Plan of one draft pass: request b's `queries_per_req` nodes read its verified prefix
    (req_to_token[req_b, :seq_len_b], all visible) and, when `block` is given, the draft-block
    columns `visible[b, q]` marks.

    Layout per request: kv = prefix slots then block[b, :T]; mask row q = [1]*seq_len + visible[b, q]
    (FlashInfer's verify layout). Vectorised; runs on the batch's device.
    """
    device = seq_lens.device
    bs, kk = seq_lens.numel(), queries_per_req
    seq = seq_lens.long()
    t = 0 if block is None else block.shape[1]
    k_lens = seq + t
    k_max = int(k_lens.max()) if bs else 0
    col = torch.arange(k_max, device=device)[None, :]
    in_prefix = col < seq[:, None]
    prefix_slot = req_to_token[
        req_pool_indices.long()[:, None], col.clamp(max=req_to_token.shape[1] - 1).expand(bs, -1)
    ]
    if t:
        block_col = (col - seq[:, None]).clamp(0, t - 1)
        slot = torch.where(in_prefix, prefix_slot, torch.gather(block, 1, block_col))
    else:
        slot = prefix_slot
    valid = col < k_lens[:, None]
    kv_indices = slot[valid].long()
    kv_indptr = torch.cat([k_lens.new_zeros(1), k_lens.cumsum(0)])
    qo_indptr = torch.arange(0, (bs + 1) * kk, kk, device=device)
    if t and visible is not None:
        vis_col = torch.gather(visible, 2, block_col[:, None, :].expand(bs, kk, k_max))
        mask = (in_prefix[:, None, :] | vis_col) & valid[:, None, :]
        custom_mask = mask[valid[:, None, :].expand(bs, kk, k_max)]
    else:
        custom_mask = None
    return plan_from_ragged(qo_indptr, kv_indptr, kv_indices, custom_mask)


__all__ = [
    "committed_after_extend",
    "committed_after_verify",
    "draft_block",
    "draft_columns",
    "next_visibility",
    "only_self",
    "step_columns",
    "tree_step_plan",
]
