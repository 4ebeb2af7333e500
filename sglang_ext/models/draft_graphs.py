"""CUDA graphs for a drafter's search step (`FrontierRunner`: EAGLE-3, MoA, the draft model) and for a drafter's
whole search (`SearchRunner`) at bucketed shapes, as SGLang's eagle_draft_cuda_graph_runner does, with the same
static padded path run eagerly off CUDA (the target's forward, the buckets and the static plan: graph_runner.py).

A drafter's step is the target's static form with one row per frontier node: `FrontierRunner` takes
attention.plan_frontier's description of each of the step's attentions (per request its committed
slots and its temporary slots, on the host; per node which temporary slots are on its path, on the
device) and pads it the same way.

A drafter's whole deterministic search can go further (`SearchRunner`, as SGLang's
eagle_draft_cuda_graph_runner): every draft step, the top-k search, each node's path mask (grown on the
device from the search's parent choices) and the trees' tensors in one function per bucket, so a
propose is one replay plus a few copies; every step's temporary slots are handed out up front.

A drafter's draft-extend (`ExtendRunner`, as SGLang's draft-extend graph): its pass over each request's newly
verified tokens after its committed prefix, the prefixes read from a request-to-slot table on the device
(models/slot_table.py) that the same graph extends by the new rows' slots, so the search after it reads its
prefixes from the table too (`TablePrefixes`) instead of the host packing them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..device import to_device
from .graph_runner import (
    BATCH_BUCKETS,
    MAX_ROWS,
    NODE_BUCKETS,
    GraphCache,
    bucket,
    context_buckets,
    fill_flat,
    static_plan,
)
from .slot_table import SlotTable

StepFn = Callable[..., tuple[torch.Tensor, ...]]
# a frontier plan's description, as attention.plan_frontier takes it: per request its committed slots
# [P_i] (host), the request's temporary slots [b, E] (host), and which of them each node reads
# [b, q, E] bool (on the device: the search's choices, never read here)
FrontierSpec = tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]


class FrontierRunner:
    """A drafter's frontier step at bucketed static shapes: b requests x q tree nodes, one row each
    (request-major), each row reading, in one or more KV pools, its request's committed slots and the
    temporary slots of its own path (attention.plan_frontier's batch, one per pool), in static form

        bucket (B, Q, ((name, P, E), ...)): node j of request i at row i*Q + j; per plan: prefix [B, P] +
        prefix_len [B] as for the target, extra [B, E] the request's temporary slots and extra_mask
        [B, Q, E] which of them node j reads (copied on the device from the spec's `seen`); per-row
        int64 inputs (positions, write slots) padded with 0 (padded rows write and read slot 0 only)

    step(ids, feat, rows, plans) is the drafter's pass with `static_attention` and its logits; it is
    captured per bucket on CUDA with graphs on, else run eagerly on the same buffers."""

    def __init__(
        self,
        step: StepFn,
        device: torch.device | str,
        max_context: int,
        graphs: bool = True,
        batch_buckets: tuple[int, ...] = BATCH_BUCKETS,
        node_buckets: tuple[int, ...] = NODE_BUCKETS,
        max_rows: int = MAX_ROWS,
    ):
        self.step = step
        self.batch_buckets, self.node_buckets = tuple(batch_buckets), tuple(node_buckets)
        self.context = context_buckets(max_context)
        self.max_rows = max_rows
        self.cache = GraphCache(torch.device(device), graphs)
        self._pools: tuple = ()
        self.runs = 0

    def bucket_of(self, b: int, q: int, lens: dict[str, tuple[int, int]]):
        """The bucket of b requests x q nodes with, per plan, (longest prefix, temporary slots per
        request); None when none fits."""
        bb, qq = bucket(b, self.batch_buckets), bucket(q, self.node_buckets)
        plans = tuple((n, bucket(p, self.context), bucket(max(e, 1), self.node_buckets)) for n, (p, e) in lens.items())
        if b < 1 or q < 1 or bb is None or qq is None or bb * qq > self.max_rows:
            return None
        if any(p is None or e is None for _, p, e in plans):
            return None
        return bb, qq, plans

    def run(
        self,
        ids: torch.Tensor,  # [b*q] token ids (on the device: the search's tokens, never read here)
        feat: torch.Tensor | None,  # [b*q, H] the rows' input features, if the step takes any
        rows: dict[str, torch.Tensor],  # name -> [b*q] int64 host values per row (positions, write slots)
        plans: dict[str, FrontierSpec],  # name -> (prefixes, extra, seen) of one pool's attention
        pools: tuple,  # the KV pools the step writes and reads (graphs bake their addresses in)
    ) -> tuple[torch.Tensor, ...] | None:
        """step's outputs for the b*q real rows (copies: the next replay overwrites the graph's), or None
        when the batch fits no bucket (the caller runs its eager step)."""
        b = len(next(iter(plans.values()))[0])
        q = ids.numel() // b if b else 0
        lens = {n: (max(p.numel() for p in pre), extra.shape[1]) for n, (pre, extra, _) in plans.items()}
        key = self.bucket_of(b, q, lens) if b else None
        if key is None or any(tuple(seen.shape[:2]) != (b, q) for _, _, seen in plans.values()):
            return None
        if len(pools) != len(self._pools) or any(a is not c for a, c in zip(pools, self._pools)):
            self.cache.clear()
            self._pools = tuple(pools)
        self.runs += 1
        bb, qq, plan_keys = key
        longs, mask = _frontier_host(key, b, q, rows, plans)
        names = tuple(rows)
        device = self.cache.device

        def fill(bufs: dict) -> None:
            fill_flat(bufs["longs"], longs)
            fill_flat(bufs["mask"], mask)
            at = 0
            for name, _, e in plan_keys:  # each node's path, where the search put it
                seen = plans[name][2]
                bufs["mask"][at : at + bb * qq * e].view(bb, qq, e)[:b, :q, : seen.shape[2]].copy_(seen)
                at += bb * qq * e
            bufs["ids"].view(bb, qq)[:b, :q].copy_(to_device(ids, device).view(b, q))
            if feat is not None:
                bufs["feat"].view(bb, qq, -1)[:b, :q].copy_(to_device(feat, device).view(b, q, -1))

        def make() -> dict:
            empty = {n: torch.empty(0, dtype=torch.long) for n in names}
            host_longs, host_mask = _frontier_host(key, 0, 0, empty, {})
            bufs = {
                "longs": to_device(host_longs, device),
                "mask": to_device(host_mask, device),
                "ids": torch.zeros(bb * qq, dtype=torch.long, device=device),
            }
            if feat is not None:
                bufs["feat"] = torch.zeros(bb * qq, feat.shape[-1], dtype=feat.dtype, device=device)
            return bufs

        out = self.cache.run((key, names, feat is not None), make, fill, lambda bufs: self._step(key, names, bufs))
        n = b * q
        return tuple(o.view(bb, qq, *o.shape[1:])[:b, :q].reshape(n, *o.shape[1:]).clone() for o in out)

    def _step(self, key, names: tuple[str, ...], bufs: dict) -> tuple[torch.Tensor, ...]:
        """The captured function: the buffers' views, the static plans, the drafter's step."""
        bb, qq, plan_keys = key
        sizes = [bb * qq] * len(names) + [x for _, p, e in plan_keys for x in (bb * p, bb, bb * e)]
        longs = bufs["longs"].split(sizes)
        masks = bufs["mask"].split([bb * qq * e for _, _, e in plan_keys])
        rows = dict(zip(names, longs))
        plans = {}
        for i, (n, p, e) in enumerate(plan_keys):
            prefix, prefix_len, extra = longs[len(names) + 3 * i : len(names) + 3 * i + 3]
            plans[n] = static_plan(prefix.view(bb, p), prefix_len, extra.view(bb, e), masks[i].view(bb, qq, e))
        return tuple(self.step(bufs["ids"], bufs.get("feat"), rows, plans))


def _frontier_host(key, b: int, q: int, rows: dict, plans: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Host side of a frontier bucket: one int64 tensor [each row input [B*Q] | per plan: prefix [B*P],
    prefix_len [B], extra [B*E]] and one bool tensor [per plan: extra_mask [B*Q*E]], the real rows'
    masks left False (run() copies each node's path in on the device). A padded row (padded request or
    node) reads extra column 0, so its softmax is never over nothing."""
    bb, qq, plan_keys = key
    longs, masks = [], []
    for vals in rows.values():
        grid = torch.zeros(bb, qq, dtype=torch.long)
        if b:
            grid[:b, :q] = torch.as_tensor(vals, dtype=torch.long).view(b, q)
        longs.append(grid.view(-1))
    for name, p, e in plan_keys:
        prefix, prefix_len = padded_prefixes(plans[name][0] if name in plans else [], bb, p)
        extra, mask = torch.zeros(bb, e, dtype=torch.long), torch.zeros(bb, qq, e, dtype=torch.bool)
        mask[:, :, 0] = True
        mask[:b, :q, 0] = False
        if name in plans:
            slots = plans[name][1]
            extra[:b, : slots.shape[1]] = slots
        longs += [prefix.view(-1), prefix_len, extra.view(-1)]
        masks.append(mask.view(-1))
    return torch.cat(longs), torch.cat(masks)


@dataclass(frozen=True)
class TablePrefixes:
    """Requests' committed slots held on the device: rows[i] of `table` holds request i's first lens[i] slots."""

    table: SlotTable
    rows: list[int]
    lens: list[int]


# an ExtendRunner's step(ids [R], feat [R, F], positions [R], slots [R], plan StaticPlan) -> outputs [R, ...]
ExtendFn = Callable[..., tuple[torch.Tensor, ...]]


class ExtendRunner:
    """A drafter's draft-extend at bucketed static shapes: b requests with q_lens[i] newly verified rows each,
    causal among themselves, after their committed prefixes, which a SlotTable on the device holds (keyed by
    request: only what its rows lack goes up, models/slot_table.py); the graph appends every row's slot to its
    request's table row, so the table holds each request's extended prefix after it (`prefixes`).

        bucket (B, Q, P): request i's rows at i*Q + j (padding: token 0, position 0, slot 0); the rows' input
        features [T, F] packed at the front of a [B*Q, F] buffer, gathered on the device (request i's row j
        reads packed row sum(q_lens[:i]) + j, counted from the non-zero slots; padding reads row 0)

    run returns each request's last row of each of step's outputs (copies: the next replay overwrites them)."""

    def __init__(
        self,
        step: ExtendFn,
        device: torch.device | str,
        max_context: int,
        graphs: bool = True,
        batch_buckets: tuple[int, ...] = BATCH_BUCKETS,
        node_buckets: tuple[int, ...] = NODE_BUCKETS,
        max_rows: int = MAX_ROWS,
    ):
        self.step = step
        self.batch_buckets, self.node_buckets = tuple(batch_buckets), tuple(node_buckets)
        self.context = context_buckets(max_context)
        self.max_rows = max_rows
        self.cache = GraphCache(torch.device(device), graphs)
        self.table = SlotTable(2 * self.batch_buckets[-1] + 1, self.context[-1] + 1, self.cache.device)
        self._pools: tuple = ()
        self.runs = 0

    def bucket_of(self, q_lens: list[int], prefix_lens: list[int]) -> tuple[int, int, int] | None:
        """The (B, Q, P) bucket of the batch, or None when it fits none (the caller runs its eager pass)."""
        if not q_lens or min(q_lens) < 1:
            return None
        b, q = bucket(len(q_lens), self.batch_buckets), bucket(max(q_lens), self.node_buckets)
        p = bucket(max(prefix_lens), self.context)
        if b is None or q is None or p is None or b * q > self.max_rows:
            return None
        if max(n + k for n, k in zip(prefix_lens, q_lens)) > self.table.width:
            return None
        return b, q, p

    def run(
        self,
        keys: list,  # per request its key (a request id: forget() it when the request ends)
        ids: list[int],  # [T] the rows' tokens, request after request
        positions: list[int],  # [T]
        slots: torch.Tensor,  # [T] int64 host ids: where each row's K/V is written (kept: they join the prefix)
        q_lens: list[int],  # rows per request
        prefixes: list[torch.Tensor],  # per request [P_i] its committed slots before these rows (host)
        feat: torch.Tensor,  # [T, F] the rows' input features (on the device)
        pools: tuple,  # the KV pools the step writes and reads (graphs bake their addresses in)
    ) -> tuple[torch.Tensor, ...] | None:
        """step's outputs at each request's last row [b, ...], or None when no bucket fits."""
        key = self.bucket_of(q_lens, [p.numel() for p in prefixes])
        if key is None:
            return None
        if len(pools) != len(self._pools) or any(a is not c for a, c in zip(pools, self._pools)):
            self.cache.clear()
            self._pools = tuple(pools)
        self.runs += 1
        b, t = len(keys), feat.shape[0]
        longs, overflow, done = self.table.inputs(key, keys, q_lens, prefixes, [*ids, *positions], [slots], True)
        if overflow is not None:
            self.table.write(overflow)
        device = self.cache.device

        def make() -> dict:
            bb, q, _ = key
            return {
                "longs": torch.zeros(5 * bb * q + 2 * bb, dtype=torch.long, device=device),
                "feat": torch.zeros(bb * q, feat.shape[1], dtype=feat.dtype, device=device),
            }

        def fill(bufs: dict) -> None:
            fill_flat(bufs["longs"], longs)
            bufs["feat"][:t].copy_(feat)

        out = self.cache.run((key, feat.shape[1], feat.dtype), make, fill, lambda bufs: self._extend(key, bufs))
        done()
        return tuple(o[:b].clone() for o in out)

    def prefixes(self, keys: list, lens: list[int]) -> "TablePrefixes | None":
        """The requests' prefixes as the table holds them after a run (lens: their committed slots now), or None
        when a row does not hold them."""
        rows = self.table.rows_of(keys, lens)
        return None if rows is None else TablePrefixes(self.table, rows, list(lens))

    def forget(self, key) -> None:
        self.table.forget(key)

    def _extend(self, key: tuple[int, int, int], bufs: dict) -> tuple[torch.Tensor, ...]:
        """The captured function: the table's rows made whole (and extended) and read, the rows' features
        gathered, the causal static plan, the drafter's step; each request's last row."""
        b, q, _ = key
        ids, pos, slots, prefix, prefix_len = self.table.read(bufs["longs"], key, append=True)
        real = (slots > 0).view(b, q)
        n = real.sum(1)
        ar = torch.arange(q, device=slots.device)
        feat = bufs["feat"][torch.where(real, (n.cumsum(0) - n)[:, None] + ar, 0).view(-1)]
        causal = (ar[None, :] <= ar[:, None]).expand(b, q, q)  # row j sees rows 0..j of its request
        plan = static_plan(prefix, prefix_len, slots.view(b, q), causal)
        last = (n - 1).clamp(min=0) + torch.arange(b, device=slots.device) * q
        return tuple(o[last] for o in self.step(ids, feat, pos, slots, plan))


@dataclass
class SearchBuffers:
    """A search bucket's static inputs as its captured function sees them: B requests, the real ones
    first, then padding."""

    rows: dict[str, torch.Tensor]  # name -> [B, n] int64 per-request host values (padding: 0)
    prefixes: dict[str, tuple[torch.Tensor, torch.Tensor]]  # name -> (prefix [B, P] slots, prefix_len [B])
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [B, ...] device inputs
    real: torch.Tensor | None = None  # [B] bool: a real request, not padding


# search(buffers) -> outputs, each [B, ...]
SearchFn = Callable[[SearchBuffers], tuple[torch.Tensor, ...]]


class SearchRunner:
    """A drafter's whole tree search (every draft step, the top-k search, each node's path, the trees'
    tensors) as one static function per bucket, as SGLang's eagle_draft_cuda_graph_runner captures
    its draft: one CUDA graph replay per propose on CUDA with graphs on, else the same function run
    eagerly on the same buffers.

        bucket (B, ((name, P), ...), the caller's key): B requests (batch padded up); per plan the
        requests' committed slots prefix [B, P] + prefix_len [B] (as the target's); per-request int64
        rows [B, n] (root tokens, lengths, every step's temporary slots: padding 0, so a padded
        request writes and reads the scratch slot 0 only); device inputs [B, ...]; real [B] bool

    A step's host values go up in one copy (one int64 buffer), each device input in one device copy;
    the outputs come back as copies of the real requests' rows (the next replay overwrites the graph's).
    The caller's function decides what a padded request computes; it must stay finite and apart."""

    def __init__(
        self,
        device: torch.device | str,
        max_context: int,
        graphs: bool = True,
        batch_buckets: tuple[int, ...] = BATCH_BUCKETS,
    ):
        self.batch_buckets = tuple(batch_buckets)
        self.context = context_buckets(max_context)
        self.cache = GraphCache(torch.device(device), graphs)
        self._pools: tuple = ()
        self.runs = 0

    def bucket_of(self, b: int, prefix_lens: dict[str, int]):
        """The bucket of b requests whose longest committed prefix per plan is prefix_lens[name]; None
        when none fits."""
        bb = bucket(b, self.batch_buckets)
        plans = tuple((n, bucket(p, self.context)) for n, p in prefix_lens.items())
        if b < 1 or bb is None or any(p is None for _, p in plans):
            return None
        return bb, plans

    def run(
        self,
        key,  # what else shapes the function (a tree shape): one graph per (bucket, key)
        search: SearchFn,
        rows: dict[str, torch.Tensor],  # name -> [b, n] int64 on the host
        prefixes: dict[str, "list[torch.Tensor] | TablePrefixes"],  # name -> per request its committed slots [P_i]
        # (host), or where a table on the device holds them (read there, nothing packed on the host)
        inputs: dict[str, torch.Tensor],  # name -> [b, ...] on the device
        pools: tuple,  # the KV pools the search writes and reads (graphs bake their addresses in)
    ) -> tuple[torch.Tensor, ...] | None:
        """search's outputs for the b real requests, or None when no bucket fits (the caller searches
        step by step)."""
        b = next(iter(rows.values())).shape[0]
        lens = {
            n: pre.lens if isinstance(pre, TablePrefixes) else [p.numel() for p in pre] for n, pre in prefixes.items()
        }
        bk = self.bucket_of(b, {n: max(x) for n, x in lens.items()})
        if bk is None:
            return None
        tables = {n: pre.table for n, pre in prefixes.items() if isinstance(pre, TablePrefixes)}
        pools = (*pools, *(t.table for t in tables.values()))
        if len(pools) != len(self._pools) or any(a is not c for a, c in zip(pools, self._pools)):
            self.cache.clear()
            self._pools = tuple(pools)
        self.runs += 1
        widths = tuple((n, r.shape[1]) for n, r in rows.items())
        specs = tuple((n, tuple(x.shape[1:]), x.dtype) for n, x in inputs.items())
        device = self.cache.device
        host = _search_host(bk, widths, b, rows, prefixes, tuple(tables))

        def make() -> dict:
            bufs = {"longs": to_device(_search_host(bk, widths, 0, {}, {}, tuple(tables)), device)}
            for n, shape, dtype in specs:
                bufs[n] = torch.zeros(bk[0], *shape, dtype=dtype, device=device)
            return bufs

        def fill(bufs: dict) -> None:
            fill_flat(bufs["longs"], host)
            for n, x in inputs.items():
                bufs[n][:b].copy_(x)

        def static(bufs: dict) -> tuple[torch.Tensor, ...]:
            bb, plans = bk
            sizes = [bb * w for _, w in widths] + [bb if n in tables else bb * p for n, p in plans] + [bb] * len(plans)
            longs = bufs["longs"].split(sizes + [bb])
            k = len(widths)
            found = {}
            for i, (n, p) in enumerate(plans):
                at, prefix_len = longs[k + i], longs[k + len(plans) + i]
                # a table's plan: the requests' rows of it (padding: the scratch row 0, its columns masked)
                prefix = tables[n].table[:, :p].index_select(0, at) if n in tables else at.view(bb, p)
                found[n] = (prefix, prefix_len)
            view = SearchBuffers(
                {n: t.view(bb, w) for (n, w), t in zip(widths, longs)},
                found,
                {n: bufs[n] for n, _, _ in specs},
                longs[-1] > 0,
            )
            return tuple(search(view))

        out = self.cache.run((bk, widths, specs, tuple(tables), key), make, fill, static)
        return tuple(o[:b].clone() for o in out)


def _search_host(bk, widths, b: int, rows: dict, prefixes: dict, tables: tuple[str, ...] = ()) -> torch.Tensor:
    """Host side of a search bucket, one int64 tensor: [each row [B*n] | per plan: prefix [B*P] (a table's
    plan: its rows [B]) | per plan: prefix_len [B] | real [B]], the first b requests' values filled in, the rest
    0. The table plans' ints and real go in as one tensor."""
    bb, plans = bk
    parts = []
    for name, w in widths:
        grid = torch.zeros(bb, w, dtype=torch.long)
        if b:
            grid[:b] = rows[name]
        parts.append(grid.view(-1))
    pad = [0] * (bb - b)
    lens, ints = [], []
    for name, p in plans:
        if name in tables:
            pre = prefixes[name] if b else None
            ints.append(len(parts))
            parts.append([*pre.rows, *pad] if b else [0] * bb)
            lens.append([*pre.lens, *pad] if b else [0] * bb)
        else:
            prefix, prefix_len = padded_prefixes(prefixes.get(name, []) if b else [], bb, p)
            parts.append(prefix.view(-1))
            lens.append(prefix_len)
    for x in lens:
        if isinstance(x, list):
            ints.append(len(parts))
        parts.append(x)
    ints.append(len(parts))
    parts.append([1] * b + pad)
    # the plain ints (table rows, their lengths, real) in one tensor, split back into their places
    flat = torch.tensor([v for i in ints for v in parts[i]], dtype=torch.long).split(bb)
    for i, t in zip(ints, flat):
        parts[i] = t
    return torch.cat(parts)


def padded_prefixes(prefixes: list[torch.Tensor], bb: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request its committed slots [P_i] (host) -> prefix [bb, p] int64 (request i's slots at the
    start of row i, padding slot 0) and prefix_len [bb] (P_i; 0 for the padded rows), on the host in a
    fixed number of ops whatever the batch: the cells below each row's length, row-major, take the
    concatenated slots in one masked assignment."""
    prefix_len = torch.tensor([t.numel() for t in prefixes] + [0] * (bb - len(prefixes)), dtype=torch.long)
    prefix = torch.zeros(bb, p, dtype=torch.long)
    if prefixes:
        flat = torch.cat(prefixes) if len(prefixes) > 1 else prefixes[0]
        prefix[torch.arange(p) < prefix_len[:, None]] = flat.long()
    return prefix, prefix_len
