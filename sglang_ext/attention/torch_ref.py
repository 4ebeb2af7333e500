"""Reference tree attention: gather the planned KV slots, one masked SDPA call for the batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .plan import AttentionPlan


def tree_attention_torch(
    q: torch.Tensor,  # [T, Hq, D] flat queries
    k_pool: torch.Tensor,  # [S, Hkv, D]
    v_pool: torch.Tensor,  # [S, Hkv, D]
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    qb = q[plan.q_index].transpose(1, 2)  # [B, Hq, Qmax, D]
    kb = k_pool[plan.kv_slots].transpose(1, 2)  # [B, Hkv, Kmax, D]
    vb = v_pool[plan.kv_slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=plan.mask, scale=scale, enable_gqa=kb.shape[1] != qb.shape[1])
    out = out.transpose(1, 2)  # [B, Qmax, Hq, D]
    if plan.batch_size == 1:
        return out[0, : q.shape[0]]
    return out[plan.q_valid]
