"""Tree-attention backends behind one signature: fn(q, k_pool, v_pool, plan, scale) -> out.

- cpu: our AVX2 kernel for few queries per request (decode, verify, draft steps), reading the pool
  in place; torch for the rest (prefill, bf16, autograd). The CPU default when the kernel is built.
- torch: batched matmuls / SDPA over gathered slots with an explicit mask (the reference).
- triton: a tree-masked attention kernel reading the pool through kv_indices (GPU; checked on CPU
  against torch under TRITON_INTERPRET=1).
"""

from __future__ import annotations

from typing import Callable

import torch

from .cpu import tree_attention_cpu
from .plan import (
    AttentionPlan,
    FrontierPaths,
    advance_seen,
    causal_mask,
    causal_masks,
    frontier_fields,
    plan_attention,
    plan_flat,
    plan_frontier,
    prefix_and_tree_mask,
)
from .torch_ref import tree_attention_torch

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionPlan, float], torch.Tensor]


def select_backend(device: torch.device | str, name: str = "auto") -> AttentionFn:
    """The fastest correct backend for the device ('auto'), or the named one."""
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu"
    if name == "torch":
        return tree_attention_torch
    if name == "cpu":
        return tree_attention_cpu
    if name == "triton":
        from .triton_tree import tree_attention_triton

        return tree_attention_triton
    raise ValueError(f"unknown attention backend {name!r}; choose auto, cpu, torch or triton")


__all__ = [
    "AttentionFn",
    "AttentionPlan",
    "FrontierPaths",
    "advance_seen",
    "causal_mask",
    "causal_masks",
    "plan_attention",
    "plan_flat",
    "frontier_fields",
    "plan_frontier",
    "prefix_and_tree_mask",
    "select_backend",
    "tree_attention_cpu",
    "tree_attention_torch",
]
