"""The "cpu" tree-attention backend: our AVX2 kernel (sglang_ext/kernels/cpu_attention.cpp) for
few queries per request, the torch reference for everything else.

The kernel reads the plan's ragged view (the pool in place, no gathered copies) and does a layer's
attention in one call, where the torch path spends its time on a dozen small ops per layer. Each
query row is computed alone in a fixed order, so a decode row and the same row inside a verify
tree are bit-identical. Used when: the kernel is built, fp32, CPU, head dim 64 or 128, at most
MAX_Q queries per request (longer blocks are prefill, where SDPA's tiling wins), and no autograd. A
batch with both (a prompt prefilled in the same forward as other requests' decode steps) is split:
the kernel for the few-query requests, torch for the prompt blocks. What it buys:
`scripts/kernel-ab.py --attention` (docs/BENCHMARKS.md, "CPU kernels").
"""

from __future__ import annotations

import torch

from .. import kernels
from .plan import AttentionPlan
from .torch_ref import tree_attention_torch

MAX_Q = 64


def uses_attention_kernel(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: AttentionPlan) -> bool:
    return plan.max_q_len <= MAX_Q and _kernel_fits(q, k_pool, v_pool)


def _kernel_fits(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    return (
        kernels.AVAILABLE
        and q.dtype == k_pool.dtype == v_pool.dtype == torch.float32
        and q.device.type == k_pool.device.type == "cpu"
        and q.shape[-1] == k_pool.shape[-1] == v_pool.shape[-1] in (64, 128)
        and k_pool.stride(-1) == 1
        and v_pool.stride(-1) == 1
        and not (torch.is_grad_enabled() and (q.requires_grad or k_pool.requires_grad or v_pool.requires_grad))
    )


def tree_attention_cpu(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: AttentionPlan, scale: float
) -> torch.Tensor:
    """Same signature and result (up to fp32 rounding) as tree_attention_torch."""
    if not _kernel_fits(q, k_pool, v_pool):
        return tree_attention_torch(q, k_pool, v_pool, plan, scale)
    if plan.max_q_len <= MAX_Q:
        return _kernel(q, k_pool, v_pool, plan, scale)
    split = plan.split_by_queries(MAX_Q)
    if split is None:
        return tree_attention_torch(q, k_pool, v_pool, plan, scale)
    out = q.new_empty(q.shape[0], q.shape[1], v_pool.shape[-1])
    out[split.short_rows] = _kernel(q[split.short_rows], k_pool, v_pool, split.short, scale)
    out[split.long_rows] = tree_attention_torch(q[split.long_rows], k_pool, v_pool, split.long, scale)
    return out


def _kernel(q, k_pool, v_pool, plan: AttentionPlan, scale: float) -> torch.Tensor:
    return kernels.tree_attention(
        q, k_pool, v_pool, plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.custom_mask, scale
    )
