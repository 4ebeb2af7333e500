"""Tree-attention planning: pure host functions that turn per-request (kv slots, mask) into index
tensors. Computed once per forward step and shared by every layer and every backend.

Batch layout (flat, like SGLang): the queries of all requests are concatenated.

    request:        a (q_len 2, kv 4)          b (q_len 1, kv 3)
    flat q rows:    [a0 a1 | b0]               qo_indptr = [0, 2, 3]
    kv slots:       [7 8 9 10 | 3 4 5]         kv_indptr = [0, 4, 7], kv_indices = the slots
    custom_mask:    a: 2x4 rows, b: 1x3 row, flattened row-major and concatenated (FlashInfer's layout)

The padded view is what the torch backend consumes: requests are bucketed by kv length (sorted,
a new bucket when a request's kv is more than `PAD_WASTE` x the bucket's shortest), and each bucket
is padded to its own longest request. One padded batch for all would make 63 short requests pay for
one long one (measured on SmolLM2 at bs 64: 15x slower decode attention). Requests with more than
`LONG_Q` queries (a prefill riding along with decode steps) are bucketed apart from the rest, or
every decode request of their bucket would be padded to the prompt's length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

PAD_WASTE = 1.5
LONG_Q = 64  # more queries than this: a prompt block, not a decode / verify / draft step


@dataclass
class PaddedGroup:
    """Some requests of the batch, padded to their longest: what one SDPA / batched matmul consumes."""

    q_index: torch.Tensor  # [G, Qmax] int64, flat query row (padding -> 0)
    q_valid: torch.Tensor  # [G, Qmax] bool
    kv_slots: torch.Tensor  # [G, Kmax] int64 (padding -> slot 0)
    mask: torch.Tensor | None  # [G, 1, Qmax, Kmax] bool; None when every query sees every kv

    @property
    def rows(self) -> torch.Tensor:
        """Flat query rows this group's output fills, in the order of out[q_valid]."""
        return self.q_index[self.q_valid]


@dataclass
class AttentionPlan:
    # ragged (FlashInfer/Triton) view
    qo_indptr: torch.Tensor  # [B+1] int64
    kv_indptr: torch.Tensor  # [B+1] int64
    kv_indices: torch.Tensor  # [sum K_b] int64, slots in the KV pool
    custom_mask: torch.Tensor  # [sum Q_b*K_b] bool, row-major per request
    # padded (torch) view: requests bucketed by kv length; one group covering the batch in order
    # means the output needs no scatter
    groups: list[PaddedGroup]
    _splits: dict = field(default_factory=dict, repr=False, compare=False)  # split_by_queries, per max_q

    @property
    def batch_size(self) -> int:
        return self.qo_indptr.numel() - 1

    @property
    def num_queries(self) -> int:
        return int(self.qo_indptr[-1])

    @cached_property
    def max_q_len(self) -> int:
        """The most queries any request has (once per plan, not once per layer)."""
        return int((self.qo_indptr[1:] - self.qo_indptr[:-1]).max())

    def split_by_queries(self, max_q: int) -> PlanSplit | None:
        """The requests with at most max_q queries and the others as two plans, with the flat query rows
        each covers; None unless the batch has both kinds. Cached per max_q (built once per forward,
        used by every layer)."""
        if max_q not in self._splits:
            self._splits[max_q] = _split(self, max_q)
        return self._splits[max_q]


@dataclass
class PlanSplit:
    """A mixed batch (decode rows next to a prompt block) as two plans, so each part gets the
    attention path suited to it."""

    short_rows: torch.Tensor  # [T_short] flat query rows of the requests with few queries
    short: AttentionPlan
    long_rows: torch.Tensor
    long: AttentionPlan


def _split(plan: AttentionPlan, max_q: int) -> PlanSplit | None:
    q_lens = (plan.qo_indptr[1:] - plan.qo_indptr[:-1]).tolist()
    k_lens = (plan.kv_indptr[1:] - plan.kv_indptr[:-1]).tolist()
    is_short = [q <= max_q for q in q_lens]
    if all(is_short) or not any(is_short):
        return None
    q0, k0 = plan.qo_indptr.tolist(), plan.kv_indptr.tolist()
    m0 = [0]
    for q, k in zip(q_lens, k_lens):
        m0.append(m0[-1] + q * k)
    parts = []
    for want in (True, False):
        idx = [b for b, s in enumerate(is_short) if s == want]
        rows = torch.cat([torch.arange(q0[b], q0[b + 1]) for b in idx])
        slots = [plan.kv_indices[k0[b] : k0[b + 1]] for b in idx]
        masks = [plan.custom_mask[m0[b] : m0[b + 1]].view(q_lens[b], k_lens[b]) for b in idx]
        parts += [rows, plan_attention(slots, masks)]
    return PlanSplit(*parts)


def causal_mask(q_len: int, prefix_len: int) -> torch.Tensor:
    """[q_len, prefix_len + q_len]: new tokens see the whole prefix and earlier new tokens."""
    new = torch.ones(q_len, q_len, dtype=torch.bool).tril_()
    return torch.cat([torch.ones(q_len, prefix_len, dtype=torch.bool), new], dim=1)


def prefix_and_tree_mask(tree_mask: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """[N, prefix_len + N]: tree nodes see the whole prefix and their ancestors (tree_mask [N, N])."""
    n = tree_mask.shape[0]
    return torch.cat([torch.ones(n, prefix_len, dtype=torch.bool), tree_mask], dim=1)


def length_buckets(k_lens: list[int], waste: float = PAD_WASTE) -> list[list[int]]:
    """Request indices grouped by kv length: sorted, a new group when a length exceeds waste x the
    group's shortest. One group (in the original order) when that covers everyone."""
    if max(k_lens) <= waste * min(k_lens):
        return [list(range(len(k_lens)))]
    order = sorted(range(len(k_lens)), key=k_lens.__getitem__)
    groups: list[list[int]] = [[]]
    for i in order:
        if groups[-1] and k_lens[i] > waste * k_lens[groups[-1][0]]:
            groups.append([])
        groups[-1].append(i)
    return groups


def _padded(qo_start: list[int], kv_slots: list[torch.Tensor], masks: list[torch.Tensor]) -> PaddedGroup:
    q_lens = torch.tensor([m.shape[0] for m in masks])
    q_max, k_max = int(q_lens.max()), max(m.shape[1] for m in masks)
    ar_q = torch.arange(q_max)
    q_valid = ar_q[None, :] < q_lens[:, None]
    q_index = torch.where(q_valid, torch.tensor(qo_start)[:, None] + ar_q[None, :], 0)
    if len(masks) == 1:
        mask = None if bool(masks[0].all()) else masks[0][None, None]
        return PaddedGroup(q_index, q_valid, kv_slots[0].long()[None], mask)
    slots = torch.zeros(len(masks), k_max, dtype=torch.long)
    mask = torch.zeros(len(masks), q_max, k_max, dtype=torch.bool)
    for b, (s, m) in enumerate(zip(kv_slots, masks)):
        slots[b, : s.numel()] = s
        mask[b, : m.shape[0], : m.shape[1]] = m
    # NOTE: padded query rows must see something, or softmax over an empty row gives NaN.
    mask[:, :, 0] |= ~q_valid
    return PaddedGroup(q_index, q_valid, slots, mask[:, None])


def plan_attention(kv_slots: list[torch.Tensor], masks: list[torch.Tensor], waste: float = PAD_WASTE) -> AttentionPlan:
    """kv_slots[b]: [K_b] pool slots request b reads; masks[b]: [Q_b, K_b] bool (True = attend)."""
    if len(kv_slots) != len(masks) or not masks:
        raise ValueError("plan_attention needs one mask per request and at least one request")
    q_lens = [m.shape[0] for m in masks]
    k_lens = [m.shape[1] for m in masks]
    for s, k in zip(kv_slots, k_lens):
        if s.numel() != k:
            raise ValueError(f"mask has {k} kv columns but {s.numel()} slots were given")
    qo_indptr = torch.tensor([0] + q_lens).cumsum(0)
    kv_indptr = torch.tensor([0] + k_lens).cumsum(0)
    kv_indices = torch.cat(kv_slots).long()
    custom_mask = torch.cat([m.reshape(-1) for m in masks])
    starts = qo_indptr[:-1].tolist()
    long = [q > LONG_Q for q in q_lens]
    if any(long) and not all(long) and waste != float("inf"):  # bucket prompt blocks and few-query requests apart
        buckets = []
        for kind in (False, True):
            idx = [b for b in range(len(q_lens)) if long[b] == kind]
            buckets += [[idx[j] for j in g] for g in length_buckets([k_lens[b] for b in idx], waste)]
    else:
        buckets = length_buckets(k_lens, waste)
    groups = [_padded([starts[i] for i in g], [kv_slots[i] for i in g], [masks[i] for i in g]) for g in buckets]
    return AttentionPlan(qo_indptr, kv_indptr, kv_indices, custom_mask, groups)


def plan_frontier(prefixes: list[torch.Tensor], seen: list[list[list[int]]]) -> AttentionPlan:
    """A drafter's frontier step: one query per frontier node, grouped per request so the request's
    prefix is gathered once (not once per node). prefixes[i]: request i's committed slots, which all
    its nodes see; seen[i][j]: the temporary slots node j of request i also sees (its path).
    Query rows are request-major, node order within a request."""
    slots, masks = [], []
    for prefix, nodes in zip(prefixes, seen):
        extra = sorted({s for node in nodes for s in node})
        col = {s: prefix.numel() + c for c, s in enumerate(extra)}
        m = torch.zeros(len(nodes), prefix.numel() + len(extra), dtype=torch.bool)
        m[:, : prefix.numel()] = True
        for j, node in enumerate(nodes):
            m[j, [col[s] for s in node]] = True
        slots.append(torch.cat([prefix.long(), torch.tensor(extra, dtype=torch.long)]))
        masks.append(m)
    return plan_attention(slots, masks)
