"""Tree-attention planning: turn per-request (kv slots, mask) into index tensors. Computed once per
forward step and shared by every layer and every backend.

Where: a plan is built on the device of its inputs' kv slots, or on an explicit `device=`; the
host part (every index derived from the requests' lengths, which are shapes: Python ints) is built
on the CPU and uploaded in one copy per dtype, and the slots and masks are only sliced and copied
on their device, never read back. A backend given q on another device uses `plan.on(q.device)`
(moved once, then cached for the other layers).

Batch layout (flat, like SGLang): the queries of all requests are concatenated.

    request:        a (q_len 2, kv 4)          b (q_len 1, kv 3)
    flat q rows:    [a0 a1 | b0]               qo_indptr = [0, 2, 3]
    kv slots:       [7 8 9 10 | 3 4 5]         kv_indptr = [0, 4, 7], kv_indices = the slots
    custom_mask:    a: 2x4 rows, b: 1x3 row, flattened row-major and concatenated (FlashInfer's layout)
                    mask_indptr = [0, 8, 11] (cumsum q_len * kv)

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
from typing import Any, Callable

import torch

from ..device import to_device, upload

PAD_WASTE = 1.5
LONG_Q = 64  # more queries than this: a prompt block, not a decode / verify / draft step


@dataclass
class PaddedGroup:
    """Some requests of the batch, padded to their longest: what one SDPA / batched matmul consumes."""

    q_index: torch.Tensor  # [G, Qmax] int64, flat query row (padding -> 0)
    q_valid: torch.Tensor  # [G, Qmax] bool
    kv_slots: torch.Tensor  # [G, Kmax] int64 (padding -> slot 0)
    mask: torch.Tensor | None  # [G, 1, Qmax, Kmax] bool; None when every query sees every kv
    # where q_valid is True, as (group, query) index pairs: out[q_valid] without a boolean-mask
    # gather (whose size is a host read on a device); None: use the mask
    valid_at: torch.Tensor | None = None  # [2, rows] int64

    @property
    def rows(self) -> torch.Tensor:
        """Flat query rows this group's output fills, in the order of out[q_valid]."""
        return self.valid(self.q_index)

    def valid(self, x: torch.Tensor) -> torch.Tensor:
        """[G, Qmax, ...] -> [rows, ...]: x[q_valid]."""
        if self.valid_at is None:
            return x[self.q_valid]
        return x[self.valid_at[0], self.valid_at[1]]


@dataclass
class AttentionPlan:
    # ragged (FlashInfer/Triton) view
    qo_indptr: torch.Tensor  # [B+1] int64
    kv_indptr: torch.Tensor  # [B+1] int64
    kv_indices: torch.Tensor  # [sum K_b] int64, slots in the KV pool
    custom_mask: torch.Tensor  # [sum Q_b*K_b] bool, row-major per request
    # padded (torch) view: requests bucketed by kv length; one group covering the batch in order
    # means the output needs no scatter. Given as its builder where the plan is on the CPU (`groups` builds it
    # at the first read): the native CPU kernels read the ragged view only, and the padded view's host indices
    # cost ~90 us of a step there (cold caches: the weights have just streamed through them)
    _groups: list[PaddedGroup] | Callable[[], list[PaddedGroup]]
    mask_indptr: torch.Tensor | None = None  # [B+1] int64, cumsum Q_b*K_b: where each request's mask starts
    # the requests' query and kv counts on the host (None: read from the indptrs when asked)
    q_lens: tuple[int, ...] | None = None
    k_lens: tuple[int, ...] | None = None
    _splits: dict = field(default_factory=dict, repr=False, compare=False)  # split_by_queries, per max_q
    _moved: dict = field(default_factory=dict, repr=False, compare=False)  # on(), per device
    _derived: dict = field(default_factory=dict, repr=False, compare=False)  # derived(), per key

    @property
    def groups(self) -> list[PaddedGroup]:
        if callable(self._groups):
            self._groups = self._groups()
        return self._groups

    @property
    def batch_size(self) -> int:
        return self.qo_indptr.numel() - 1

    @property
    def device(self) -> torch.device:
        return self.kv_indices.device

    @property
    def num_queries(self) -> int:
        return sum(self.q_lens) if self.q_lens is not None else int(self.qo_indptr[-1])

    @cached_property
    def max_q_len(self) -> int:
        """The most queries any request has (once per plan, not once per layer)."""
        if self.q_lens is not None:
            return max(self.q_lens)
        return int((self.qo_indptr[1:] - self.qo_indptr[:-1]).max())

    def on(self, device: torch.device | str) -> AttentionPlan:
        """This plan on `device`: itself if it is all there, else a copy moved once (one upload per
        dtype) and kept for the next layer."""
        device = torch.device(device)
        if device not in self._moved:
            self._moved[device] = _moved(self, device)
        return self._moved[device]

    def derived(self, key: str, build: Callable[[], Any]) -> Any:
        """What an attention backend derives from the plan (its index arrays), built once per plan and kept for
        the other layers: build() the first time `key` is asked for."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

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


def _moved(plan: AttentionPlan, device: torch.device) -> AttentionPlan:
    ragged = [plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.custom_mask, plan.mask_indptr]
    per_group = [[g.q_index, g.q_valid, g.kv_slots, g.mask, g.valid_at] for g in plan.groups]
    tensors = ragged + [t for g in per_group for t in g]
    moved = upload(tensors, device)
    if all(a is b for a, b in zip(moved, tensors)):
        return plan
    groups = [PaddedGroup(*moved[5 + 5 * i : 10 + 5 * i]) for i in range(len(plan.groups))]
    return AttentionPlan(*moved[:4], groups, moved[4], plan.q_lens, plan.k_lens)


def _split(plan: AttentionPlan, max_q: int) -> PlanSplit | None:
    q_lens = list(plan.q_lens) if plan.q_lens is not None else (plan.qo_indptr[1:] - plan.qo_indptr[:-1]).tolist()
    k_lens = list(plan.k_lens) if plan.k_lens is not None else (plan.kv_indptr[1:] - plan.kv_indptr[:-1]).tolist()
    is_short = [q <= max_q for q in q_lens]
    if all(is_short) or not any(is_short):
        return None
    q0, k0, m0 = _cumsum(q_lens), _cumsum(k_lens), _cumsum([q * k for q, k in zip(q_lens, k_lens)])
    parts = []
    for want in (True, False):
        idx = [b for b, s in enumerate(is_short) if s == want]
        rows = to_device(torch.cat([torch.arange(q0[b], q0[b + 1]) for b in idx]), plan.device)
        slots = [plan.kv_indices[k0[b] : k0[b + 1]] for b in idx]
        masks = [plan.custom_mask[m0[b] : m0[b + 1]].view(q_lens[b], k_lens[b]) for b in idx]
        parts += [rows, plan_attention(slots, masks)]
    return PlanSplit(*parts)


def _cumsum(xs: list[int]) -> list[int]:
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


def causal_mask(q_len: int, prefix_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[q_len, prefix_len + q_len]: new tokens see the whole prefix and earlier new tokens."""
    new = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril_()
    return torch.cat([torch.ones(q_len, prefix_len, dtype=torch.bool, device=device), new], dim=1)


def causal_masks(q_lens: list[int], prefix_lens: list[int]) -> torch.Tensor:
    """[sum Q_b * (P_b + Q_b)] bool on the host: each request's causal_mask(Q_b, P_b), flat and
    concatenated (plan_flat's layout), in a fixed number of ops whatever the batch: row j of request b
    sees columns 0 .. P_b + j of its P_b + Q_b."""
    if len(q_lens) == 1:
        return causal_mask(q_lens[0], prefix_lens[0]).view(-1)
    width = torch.tensor([p + q for q, p in zip(q_lens, prefix_lens) for _ in range(q)])  # [rows]
    limit = torch.tensor([p + j for q, p in zip(q_lens, prefix_lens) for j in range(q)])  # [rows]
    cols = torch.arange(max(p + q for q, p in zip(q_lens, prefix_lens)))
    return (cols[None, :] <= limit[:, None])[cols[None, :] < width[:, None]]


def prefix_and_tree_mask(tree_mask: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """[N, prefix_len + N] on tree_mask's device: tree nodes see the whole prefix and their ancestors
    (tree_mask [N, N])."""
    n = tree_mask.shape[0]
    return torch.cat([tree_mask.new_ones(n, prefix_len, dtype=torch.bool), tree_mask.bool()], dim=1)


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


def _group_index(starts: list[int], q_lens: list[int]) -> list[torch.Tensor]:
    """Host part of a padded group, from Python ints: q_index [G, Qmax], q_valid [G, Qmax], valid_at [2, rows]."""
    q_len = torch.tensor(q_lens)
    ar_q = torch.arange(max(q_lens))
    q_valid = ar_q[None, :] < q_len[:, None]
    q_index = torch.where(q_valid, torch.tensor(starts)[:, None] + ar_q[None, :], 0)
    valid_at = torch.tensor(
        [[g for g, q in enumerate(q_lens) for _ in range(q)], [j for q in q_lens for j in range(q)]]
    )
    return [q_index, q_valid, valid_at]


def _gather_index(k_starts: list[int], k_lens: list[int], mask_starts: list[int], q_lens: list[int], pad: int):
    """Host part of a batch-wide padded group, from Python ints: slot_at [G, Kmax] (request g's column
    k at kv position k_starts[g] + k; padding -> `pad`, the pad slot's position), row_at [G, Qmax] (where
    query row j of request g starts in the flat mask: mask_starts[g] + j * k_lens[g]) and k_len [G]."""
    ar_k = torch.arange(max(k_lens))
    k_len = torch.tensor(k_lens)
    slot_at = torch.where(ar_k[None, :] < k_len[:, None], torch.tensor(k_starts)[:, None] + ar_k[None, :], pad)
    row_at = torch.tensor(mask_starts)[:, None] + torch.arange(max(q_lens))[None, :] * k_len[:, None]
    return [slot_at, row_at, k_len]


def _padded_batch(
    q_index: torch.Tensor,  # [G, Qmax] int64
    q_valid: torch.Tensor,  # [G, Qmax] bool
    valid_at: torch.Tensor,  # [2, rows] int64
    slot_at: torch.Tensor,  # [G, Kmax] int64, into kv_ext
    row_at: torch.Tensor,  # [G, Qmax] int64, into mask_ext
    k_len: torch.Tensor,  # [G] int64
    kv_ext: torch.Tensor,  # [sum K_b + 1] int64: the plan's kv_indices, then the pad slot 0
    mask_ext: torch.Tensor,  # [sum Q_b*K_b + 1] bool: the plan's custom_mask, then False
) -> PaddedGroup:
    """One group gathered from the flat slots and mask in a fixed number of device ops, whatever its
    size: cell (g, j, k) of the mask is mask_ext[row_at[g, j] + k] inside request g's Q x K block and
    the trailing False outside it."""
    ar_k = torch.arange(slot_at.shape[1], device=slot_at.device)
    inside = q_valid[:, :, None] & (ar_k[None, :] < k_len[:, None])[:, None, :]
    mask = mask_ext[torch.where(inside, row_at[:, :, None] + ar_k, mask_ext.shape[0] - 1)]
    # NOTE: padded query rows must see something, or softmax over an empty row gives NaN.
    mask[:, :, 0] |= ~q_valid
    return PaddedGroup(q_index, q_valid, kv_ext[slot_at], mask[:, None], valid_at)


def _padded(
    q_index: torch.Tensor,
    q_valid: torch.Tensor,
    valid_at: torch.Tensor,
    kv_slots: list[torch.Tensor],
    masks: list[torch.Tensor],
) -> PaddedGroup:
    """One group, request by request (a prompt block's group: few requests, each a big block, where a
    batch-wide gather index would be [G, Qmax, Kmax] int64), on the device of its index tensors."""
    q_max, k_max = q_index.shape[1], max(m.shape[1] for m in masks)
    dev = q_index.device
    slots = torch.zeros(len(masks), k_max, dtype=torch.long, device=dev)
    mask = torch.zeros(len(masks), q_max, k_max, dtype=torch.bool, device=dev)
    for b, (s, m) in enumerate(zip(kv_slots, masks)):
        slots[b, : s.numel()] = s
        mask[b, : m.shape[0], : m.shape[1]] = m
    # NOTE: padded query rows must see something, or softmax over an empty row gives NaN.
    mask[:, :, 0] |= ~q_valid
    return PaddedGroup(q_index, q_valid, slots, mask[:, None], valid_at)


def _buckets(q_lens: list[int], k_lens: list[int], waste: float) -> list[list[int]]:
    long = [q > LONG_Q for q in q_lens]
    if not (any(long) and not all(long) and waste != float("inf")):
        return length_buckets(k_lens, waste)
    buckets = []  # prompt blocks and few-query requests apart
    for kind in (False, True):
        idx = [b for b in range(len(q_lens)) if long[b] == kind]
        buckets += [[idx[j] for j in g] for g in length_buckets([k_lens[b] for b in idx], waste)]
    return buckets


def plan_attention(
    kv_slots: list[torch.Tensor],
    masks: list[torch.Tensor],
    waste: float = PAD_WASTE,
    device: torch.device | str | None = None,
) -> AttentionPlan:
    """kv_slots[b]: [K_b] pool slots request b reads; masks[b]: [Q_b, K_b] bool (True = attend).
    Built on `device` (default: the slots' device); see the module docstring."""
    if len(kv_slots) != len(masks) or not masks:
        raise ValueError("plan_attention needs one mask per request and at least one request")
    q_lens = [m.shape[0] for m in masks]
    k_lens = [m.shape[1] for m in masks]
    for s, k in zip(kv_slots, k_lens):
        if s.numel() != k:
            raise ValueError(f"mask has {k} kv columns but {s.numel()} slots were given")

    def all_visible(b: int) -> bool:  # (read on the host only where the mask lives there)
        return masks[b].device.type == "cpu" and bool(masks[b].all())

    return _plan(kv_slots, [m.reshape(-1) for m in masks], q_lens, k_lens, waste, device, all_visible)


def plan_flat(
    kv_slots: list[torch.Tensor],
    custom_mask: torch.Tensor,
    q_lens: list[int],
    waste: float = PAD_WASTE,
    device: torch.device | str | None = None,
) -> AttentionPlan:
    """plan_attention with the masks given flat: custom_mask [sum Q_b*K_b] bool, request b's
    [Q_b, K_b] block row-major at cumsum Q*K (K_b = kv_slots[b].numel()), as a batch-wide mask
    builder (causal_masks) makes it, with no tensor per request."""
    if len(kv_slots) != len(q_lens) or not q_lens:
        raise ValueError("plan_flat needs one query count per request and at least one request")
    k_lens = [s.numel() for s in kv_slots]
    m0 = _cumsum([q * k for q, k in zip(q_lens, k_lens)])
    if custom_mask.numel() != m0[-1]:
        raise ValueError(f"flat mask of {custom_mask.numel()} cells for {m0[-1]} (sum Q_b * K_b)")

    def all_visible(b: int) -> bool:
        return custom_mask.device.type == "cpu" and bool(custom_mask[m0[b] : m0[b + 1]].all())

    return _plan(kv_slots, [custom_mask.reshape(-1)], q_lens, k_lens, waste, device, all_visible)


def _plan(
    kv_slots: list[torch.Tensor],
    mask_parts: list[torch.Tensor],
    q_lens: list[int],
    k_lens: list[int],
    waste: float,
    device: torch.device | str | None,
    all_visible,
) -> AttentionPlan:
    """The plan from the requests' slots and their masks' flat parts (concatenated: the flat mask).
    Every index comes from the lengths (Python ints) on the host, in one upload with the slots and
    the mask; a group of few-query requests is gathered from the flat slots and mask in a fixed number
    of ops (_padded_batch), a group of one request is a view, a prompt blocks' group goes request by
    request (_padded)."""
    device = torch.device(device) if device is not None else kv_slots[0].device
    n_kv = sum(k_lens)
    q0, k0, m0 = _cumsum(q_lens), _cumsum(k_lens), _cumsum([q * k for q, k in zip(q_lens, k_lens)])
    buckets = _buckets(q_lens, k_lens, waste)
    kinds = ["one" if len(g) == 1 else "batch" if max(q_lens[i] for i in g) <= LONG_Q else "loop" for g in buckets]

    def group_host() -> tuple[list[torch.Tensor], list[int]]:
        host, at = [], []  # per group: where its host tensors start in `host`
        for g, kind in zip(buckets, kinds):
            at.append(len(host))
            host += _group_index([q0[i] for i in g], [q_lens[i] for i in g])
            if kind == "batch":
                ks, ms = [k0[i] for i in g], [m0[i] for i in g]
                host += _gather_index(ks, [k_lens[i] for i in g], ms, [q_lens[i] for i in g], n_kv)
        return host, at

    # a batch-wide group's padding gathers a trailing pad slot (0) and a trailing False
    pad = "batch" in kinds
    if pad:
        kv_slots = [*kv_slots, kv_slots[0].new_zeros(1)]
        mask_parts = [*mask_parts, torch.zeros(1, dtype=torch.bool, device=mask_parts[0].device)]
    kv_ext = (torch.cat(kv_slots) if len(kv_slots) > 1 else kv_slots[0]).long()
    mask_ext = (torch.cat(mask_parts) if len(mask_parts) > 1 else mask_parts[0]).bool()
    host = [torch.tensor(q0), torch.tensor(k0), torch.tensor(m0)]
    lazy = device.type == "cpu"  # (on a device the groups' indices go up in the one upload, with the rest)
    grouped, at = ([], []) if lazy else group_host()
    placed = upload(host + grouped + [kv_ext, mask_ext], device)
    kv_ext, mask_ext = placed[-2:]
    kv_indices, custom_mask = (kv_ext[:-1], mask_ext[:-1]) if pad else (kv_ext, mask_ext)

    def slots_of(b: int) -> torch.Tensor:
        return kv_indices[k0[b] : k0[b + 1]]

    def mask_of(b: int) -> torch.Tensor:
        return custom_mask[m0[b] : m0[b + 1]].view(q_lens[b], k_lens[b])

    def groups(index: list[torch.Tensor], at: list[int]) -> list[PaddedGroup]:
        out = []
        for g, kind, j in zip(buckets, kinds, at):
            idx = index[j : j + 3]
            if kind == "one":
                b = g[0]
                mask = None if all_visible(b) else mask_of(b)[None, None]
                out.append(PaddedGroup(idx[0], idx[1], slots_of(b)[None], mask, idx[2]))
            elif kind == "batch":
                out.append(_padded_batch(*idx, *index[j + 3 : j + 6], kv_ext, mask_ext))
            else:
                out.append(_padded(*idx, [slots_of(b) for b in g], [mask_of(b) for b in g]))
        return out

    qo_indptr, kv_indptr, mask_indptr = placed[:3]
    padded = (lambda: groups(*group_host())) if lazy else groups(placed[3:-2], at)
    return AttentionPlan(
        qo_indptr, kv_indptr, kv_indices, custom_mask, padded, mask_indptr, tuple(q_lens), tuple(k_lens)
    )


@dataclass
class FrontierPaths:
    """A drafter's tree search in flight: the temporary KV slots its passes wrote, and which of them
    each frontier node reads (its path: its ancestors' slots and its own), kept without reading the
    device, where the search's choices (each node's parent) live.

        slots  [b, E] int64 on the host: request i's temporary slots, pass after pass (slot ids are host
               values: the pools hand them out)
        seen   [b, q, E] bool on the search's device: node j of the current frontier reads column e
        last   the current frontier's node count per request (its own columns are the last `last`)

    A pass over kk nodes per request appends their slots; node j's row is its parent's row (gathered
    on the device) plus its own column. A request's E is the same for every request: each pass
    gives every request the same number of nodes."""

    slots: torch.Tensor
    seen: torch.Tensor
    last: int = 0

    @classmethod
    def start(cls, b: int, device: torch.device | str) -> "FrontierPaths":
        """No pass yet: one (root) row per request, reading no temporary slot."""
        return cls(torch.zeros(b, 0, dtype=torch.long), torch.zeros(b, 1, 0, dtype=torch.bool, device=device))

    def advance(self, new: torch.Tensor, parent: torch.Tensor | None) -> "FrontierPaths":
        """After a pass: new [b*kk] the slots its nodes wrote (request-major); parent [b, kk] each node's
        index among the previous frontier's nodes (None: all children of the one row there)."""
        b = self.slots.shape[0]
        kk = new.numel() // b
        parent = None if parent is None else to_device(parent.long(), self.seen.device)
        return FrontierPaths(
            torch.cat([self.slots, new.view(b, kk).long()], 1), advance_seen(self.seen, parent, kk), kk
        )

    def own(self) -> torch.Tensor:
        """[b, q, E] each node's own column only (a pass whose nodes see themselves, not their ancestors)."""
        b, q, e = self.seen.shape
        own = torch.eye(q, dtype=torch.bool, device=self.seen.device).expand(b, q, q)
        return torch.cat([own.new_zeros(b, q, e - q), own], 2)


def advance_seen(seen: torch.Tensor, parent: torch.Tensor | None, kk: int) -> torch.Tensor:
    """FrontierPaths' masks after a pass of kk nodes per request: seen [b, q, E] of the previous
    frontier, parent [b, kk] each new node's index in it on seen's device (None: all children of row
    0) -> [b, kk, E + kk], each node its parent's row plus its own new column. Device ops only."""
    b, _, e = seen.shape
    if parent is None:
        rows = seen[:, :1].expand(b, kk, e)
    else:
        rows = torch.gather(seen, 1, parent[..., None].expand(b, kk, e))
    own = torch.eye(kk, dtype=torch.bool, device=seen.device).expand(b, kk, kk)
    return torch.cat([rows, own], 2)


def plan_frontier(
    prefixes: list[torch.Tensor],
    extra: torch.Tensor,
    seen: torch.Tensor,
    device: torch.device | str | None = None,
) -> AttentionPlan:
    """A drafter's frontier step: one query per frontier node, grouped per request so the request's
    prefix is gathered once (not once per node). prefixes[i]: request i's committed slots, which all
    its nodes see; extra [b, E]: the request's temporary slots (host); seen [b, q, E] bool: which of
    them node j also reads (its path; FrontierPaths). Query rows are request-major, node order within
    a request. Built on `device` (default: seen's device); the masks stay where seen is, unread."""
    b, q, _ = seen.shape
    if len(prefixes) != b or extra.shape[0] != b or extra.shape[1] != seen.shape[2]:
        raise ValueError(
            f"frontier plan: {len(prefixes)} prefixes, extra slots {tuple(extra.shape)}, seen {tuple(seen.shape)}"
        )
    slots = [torch.cat([prefix.long(), extra[i].long()]) for i, prefix in enumerate(prefixes)]
    masks = [torch.cat([seen.new_ones(q, prefix.numel()), seen[i]], 1) for i, prefix in enumerate(prefixes)]
    return plan_attention(slots, masks, device=device if device is not None else seen.device)


def frontier_fields(prefixes: list[torch.Tensor], extra: torch.Tensor, seen: torch.Tensor) -> list[torch.Tensor]:
    """plan_frontier's attention as the ragged fields a native stack reads (qo_indptr, kv_indptr, kv_indices,
    custom_mask), host tensors in a few ops: request b's q = seen.shape[1] nodes read its prefix and those of
    its extra slots [E] that seen [b, q, E] marks (the same arguments as plan_frontier)."""
    b, q, e = seen.shape
    lens = [p.numel() + e for p in prefixes]
    kv_indptr = torch.tensor([0, *lens]).cumsum(0)
    indices = torch.cat([t for i, p in enumerate(prefixes) for t in (p.long(), extra[i].long())])
    mask = torch.cat([torch.cat([seen.new_ones(q, p.numel()), seen[i]], 1).flatten() for i, p in enumerate(prefixes)])
    return [torch.arange(0, b * q + 1, q), kv_indptr, indices, mask]
