"""Tree-attention planning: pure host functions that turn per-request (kv slots, mask) into index
tensors. Computed once per forward step and shared by every layer and every backend.

Batch layout (flat, like SGLang): the queries of all requests are concatenated.

    request:        a (q_len 2, kv 4)          b (q_len 1, kv 3)
    flat q rows:    [a0 a1 | b0]               qo_indptr = [0, 2, 3]
    kv slots:       [7 8 9 10 | 3 4 5]         kv_indptr = [0, 4, 7], kv_indices = the slots
    custom_mask:    a: 2x4 rows, b: 1x3 row, flattened row-major and concatenated (FlashInfer's layout)

The padded view (q_index/kv_slots/mask with a leading batch dim) is what SDPA consumes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionPlan:
    # ragged (FlashInfer/Triton) view
    qo_indptr: torch.Tensor  # [B+1] int64
    kv_indptr: torch.Tensor  # [B+1] int64
    kv_indices: torch.Tensor  # [sum K_b] int64, slots in the KV pool
    custom_mask: torch.Tensor  # [sum Q_b*K_b] bool, row-major per request
    # padded (SDPA) view
    q_index: torch.Tensor  # [B, Qmax] int64, flat query row (padding -> 0)
    q_valid: torch.Tensor  # [B, Qmax] bool
    kv_slots: torch.Tensor  # [B, Kmax] int64 (padding -> slot 0)
    mask: torch.Tensor | None  # [B, 1, Qmax, Kmax] bool; None when every query sees every kv

    @property
    def batch_size(self) -> int:
        return self.qo_indptr.numel() - 1

    @property
    def num_queries(self) -> int:
        return int(self.qo_indptr[-1])


def causal_mask(q_len: int, prefix_len: int) -> torch.Tensor:
    """[q_len, prefix_len + q_len]: new tokens see the whole prefix and earlier new tokens."""
    new = torch.ones(q_len, q_len, dtype=torch.bool).tril_()
    return torch.cat([torch.ones(q_len, prefix_len, dtype=torch.bool), new], dim=1)


def prefix_and_tree_mask(tree_mask: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """[N, prefix_len + N]: tree nodes see the whole prefix and their ancestors (tree_mask [N, N])."""
    n = tree_mask.shape[0]
    return torch.cat([torch.ones(n, prefix_len, dtype=torch.bool), tree_mask], dim=1)


def plan_attention(kv_slots: list[torch.Tensor], masks: list[torch.Tensor]) -> AttentionPlan:
    """kv_slots[b]: [K_b] pool slots request b reads; masks[b]: [Q_b, K_b] bool (True = attend)."""
    if len(kv_slots) != len(masks) or not masks:
        raise ValueError("plan_attention needs one mask per request and at least one request")
    q_lens = [m.shape[0] for m in masks]
    k_lens = [m.shape[1] for m in masks]
    for s, k in zip(kv_slots, k_lens):
        if s.numel() != k:
            raise ValueError(f"mask has {k} kv columns but {s.numel()} slots were given")
    bsz, q_max, k_max = len(masks), max(q_lens), max(k_lens)
    qo_indptr = torch.tensor([0] + q_lens).cumsum(0)
    kv_indptr = torch.tensor([0] + k_lens).cumsum(0)
    kv_indices = torch.cat(kv_slots).long()
    custom_mask = torch.cat([m.reshape(-1) for m in masks])

    ar_q = torch.arange(q_max)
    q_lens_t = torch.tensor(q_lens)
    q_valid = ar_q[None, :] < q_lens_t[:, None]
    q_index = torch.where(q_valid, qo_indptr[:-1, None] + ar_q[None, :], 0)
    if bsz == 1:
        slots = kv_indices[None]
        mask = None if bool(masks[0].all()) else masks[0][None, None]
        return AttentionPlan(qo_indptr, kv_indptr, kv_indices, custom_mask, q_index, q_valid, slots, mask)
    slots = torch.zeros(bsz, k_max, dtype=torch.long)
    mask = torch.zeros(bsz, q_max, k_max, dtype=torch.bool)
    for b, (s, m) in enumerate(zip(kv_slots, masks)):
        slots[b, : s.numel()] = s
        mask[b, : m.shape[0], : m.shape[1]] = m
    # NOTE: padded query rows must see something, or softmax over an empty row gives NaN.
    mask[:, :, 0] |= ~q_valid
    return AttentionPlan(qo_indptr, kv_indptr, kv_indices, custom_mask, q_index, q_valid, slots, mask[:, None])
