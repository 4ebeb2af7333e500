"""Reference tree attention (any device): per padded group of the plan, gather the group's KV slots
and attend with one batched call. No host reads: rows are selected by the plan's index tensors.

Small query blocks (decode, tree verify: Q <= SMALL_Q) use plain batched matmuls with the query
heads of each KV head folded into the query dim; on CPU that beats SDPA's flash kernel for these
sizes, because the flash kernel tiles queries in blocks far larger than one token. Prefill (long Q)
uses SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .plan import LONG_Q, AttentionPlan, PaddedGroup

SMALL_Q = LONG_Q  # the plan buckets requests with more queries apart, so a group is all small or all long


def _attend_small_q(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, g: PaddedGroup, scale: float
) -> torch.Tensor:
    b, qm = g.q_index.shape
    hq, d = q.shape[1], q.shape[2]
    hkv = k_pool.shape[1]
    rep = hq // hkv
    qb = q[g.q_index].view(b, qm, hkv, rep, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, rep * qm, d)
    # contiguous: a batched matmul over the strided view is ~3x slower than the copy + matmul
    kb = k_pool[g.kv_slots].transpose(1, 2).contiguous()  # [G, Hkv, K, D]
    vb = v_pool[g.kv_slots].transpose(1, 2).contiguous()
    s = torch.matmul(qb, kb.transpose(-1, -2)).float().mul_(scale)  # [G, Hkv, rep*Q, K]
    if g.mask is not None:
        s = s.view(b, hkv, rep, qm, -1).masked_fill_(~g.mask[:, :, None], float("-inf")).view(b, hkv, rep * qm, -1)
    p = s.softmax(-1).to(vb.dtype)
    out = torch.matmul(p, vb).view(b, hkv, rep, qm, -1).permute(0, 3, 1, 2, 4).reshape(b, qm, hq, -1)
    return g.valid(out)


def _attend_sdpa(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, g: PaddedGroup, scale: float
) -> torch.Tensor:
    qb = q[g.q_index].transpose(1, 2)  # [G, Hq, Qmax, D]
    kb = k_pool[g.kv_slots].transpose(1, 2)  # [G, Hkv, Kmax, D]
    vb = v_pool[g.kv_slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(
        qb, kb, vb, attn_mask=g.mask, scale=scale, enable_gqa=kb.shape[1] != qb.shape[1]
    )
    return g.valid(out.transpose(1, 2))  # [rows, Hq, D]


def tree_attention_torch(
    q: torch.Tensor,  # [T, Hq, D] flat queries
    k_pool: torch.Tensor,  # [S, Hkv, D]
    v_pool: torch.Tensor,  # [S, Hkv, D]
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    plan = plan.on(q.device)  # a plan built elsewhere moves once (cached for the other layers)

    def attend(g: PaddedGroup) -> torch.Tensor:
        fn = _attend_small_q if g.q_index.shape[1] <= SMALL_Q else _attend_sdpa
        return fn(q, k_pool, v_pool, g, scale)

    if len(plan.groups) == 1:  # one group in batch order: rows come out in order
        return attend(plan.groups[0])
    out = q.new_empty(q.shape[0], q.shape[1], v_pool.shape[-1])
    for g in plan.groups:
        out[g.rows] = attend(g)
    return out
