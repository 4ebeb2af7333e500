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
(models/slot_table.py) that the same graph extends by the new rows' slots, so the search after it (given the same
table) reads its prefixes there instead of the host packing them.

A drafter's commit of verified tokens that treats each token alone (MoA's LSA memory, CA and SA K/V: no attention
across tokens) is a row function (models/row_graphs.py: `RowRunner`), run first in its search's graph
(`SearchRunner.run`'s `first`) or alone, one graph per row bucket.
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
from .row_graphs import Rows, host_zeros
from .slot_table import SlotTable

StepFn = Callable[..., tuple[torch.Tensor, ...]]
# a frontier plan's description, as attention.plan_frontier takes it: per request its committed slots
# [P_i] (host), the request's temporary slots [b, E] (host), and which of them each node reads
# [b, q, E] bool (on the device: the search's choices, never read here)
FrontierSpec = tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]


class _BucketedRunner:
    """What FrontierRunner and ExtendRunner share: a step run at bucketed static shapes (batch, nodes or rows,
    context), captured per bucket on CUDA with graphs on (GraphCache), else run eagerly on the same buffers."""

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


class FrontierRunner(_BucketedRunner):
    """A drafter's frontier step at bucketed static shapes: b requests x q tree nodes, one row each
    (request-major), each row reading, in one or more KV pools, its request's committed slots and the
    temporary slots of its own path (attention.plan_frontier's batch, one per pool), in static form

        bucket (B, Q, ((name, P, E), ...)): node j of request i at row i*Q + j; per plan: prefix [B, P] +
        prefix_len [B] as for the target, extra [B, E] the request's temporary slots and extra_mask
        [B, Q, E] which of them node j reads (copied on the device from the spec's `seen`); per-row
        int64 inputs (positions, write slots) padded with 0 (padded rows write and read slot 0 only)

    step(ids, feat, rows, plans) is the drafter's pass with `static_attention` and its logits; it is
    captured per bucket on CUDA with graphs on, else run eagerly on the same buffers."""

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


# an ExtendRunner's step(ids [R], feat [R, F], positions [R], slots [R], plan StaticPlan) -> outputs [R, ...]
ExtendFn = Callable[..., tuple[torch.Tensor, ...]]


class ExtendRunner(_BucketedRunner):
    """A drafter's draft-extend at bucketed static shapes: b requests with q_lens[i] newly verified rows each,
    causal among themselves, after their committed prefixes, which a SlotTable on the device holds (keyed by
    request: only what its rows lack goes up, models/slot_table.py); the graph appends every row's slot to its
    request's table row, so the table holds each request's extended prefix after it (a SearchRunner reads it).

        bucket (B, Q, P): request i's rows at i*Q + j (padding: token 0, position 0, slot 0); the rows' input
        features [T, F] packed at the front of a [B*Q, F] buffer, gathered on the device (request i's row j
        reads packed row sum(q_lens[:i]) + j, counted from the non-zero slots; padding reads row 0)

    run returns each request's last row of each of step's outputs (copies: the next replay overwrites them), or,
    given a function to run after the extend in the same graph (`then`: a drafter's whole search over the
    extended prefixes, as `Extended` describes them), that function's outputs for the padded batch [B, ...], as
    the graph left them (SearchRunner.run's rule)."""

    def __init__(self, step: ExtendFn, *args, **kwargs):
        super().__init__(step, *args, **kwargs)
        self.table = self._new_table()
        self._consts: dict = {}

    def _new_table(self) -> SlotTable:
        return SlotTable(2 * self.batch_buckets[-1] + 1, self.context[-1] + 1, self.cache.device)

    def bucket_of(self, q_lens: list[int], prefix_lens: list[int]) -> tuple[int, int, int] | None:
        """The (B, Q, P) bucket of the batch (P: the extended prefixes' columns), or None when it fits none (the
        caller runs its eager pass)."""
        if not q_lens or min(q_lens) < 1:
            return None
        b, q = bucket(len(q_lens), self.batch_buckets), bucket(max(q_lens), self.node_buckets)
        p = bucket(max(n + k for n, k in zip(prefix_lens, q_lens)), self.context)
        if b is None or q is None or p is None or b * q > self.max_rows:
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
        then: tuple | None = None,  # (key, fn(last outputs, Extended) -> outputs [B, ...], the tensors fn reads)
    ) -> tuple[torch.Tensor, ...] | None:
        """step's outputs at each request's last row [b, ...] (or then's fn's outputs [b, ...]), or None when no
        bucket fits."""
        key = self.bucket_of(q_lens, [p.numel() for p in prefixes])
        if key is None:
            return None
        if len(pools) != len(self._pools) or any(a is not c for a, c in zip(pools, self._pools)):
            self.cache.clear()
            self.table = self._new_table()  # (its rows hold another pool's slots)
            self._pools = tuple(pools)
        consts = then[2] if then else ()
        if any(c is not self._consts.get(i) for i, c in enumerate(consts)):  # (then's graphs read older ones)
            self.cache.clear()
            self._consts = dict(enumerate(consts))
        self.runs += 1
        b, t = len(keys), feat.shape[0]
        longs, overflow, done = self.table.inputs(key, keys, q_lens, prefixes, [*ids, *positions], [slots], True)
        if overflow is not None:
            self.cache.stream.launch(self.table.write, overflow)
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

        fn = then[1] if then else None
        out = self.cache.run(
            (key, feat.shape[1], feat.dtype, then and then[0]), make, fill, lambda bufs: self._extend(key, bufs, fn)
        )
        done()
        # NOTE: then's outputs (a search's trees, [B, ...]) as the graph left them, read before the next run (the
        # step's verify copies the trees into its own buffers); the last rows copied (the next replay overwrites them)
        return tuple(out) if then else tuple(o[:b].clone() for o in out)

    def forget(self, key) -> None:
        self.table.forget(key)

    def _extend(self, key: tuple[int, int, int], bufs: dict, then=None) -> tuple[torch.Tensor, ...]:
        """The captured function: the table's rows made whole (and extended) and read, the rows' features
        gathered, the causal static plan, the drafter's step; each request's last row (then: then(those,
        Extended))."""
        b, q, _ = key
        ids, pos, slots, prefix, prefix_len = self.table.read(bufs["longs"], key, append=True)
        real = (slots > 0).view(b, q)
        n = real.sum(1)
        ar = torch.arange(q, device=slots.device)
        feat = bufs["feat"][torch.where(real, (n.cumsum(0) - n)[:, None] + ar, 0).view(-1)]
        return self._pass(key, ids, pos, slots, prefix, prefix_len, n, feat, ar, then)

    def _pass(self, key, ids, pos, slots, prefix, prefix_len, n, feat, ar, then=None) -> tuple[torch.Tensor, ...]:
        """The pass over the rows read (n [B]: each request's real rows, the first of its Q; ar: arange(Q) on the
        device) -> its outputs at each request's last row (then: then(those, Extended))."""
        b, q, _ = key
        causal = (ar[None, :] <= ar[:, None]).expand(b, q, q)  # row j sees rows 0..j of its request
        plan = static_plan(prefix, prefix_len, slots.view(b, q), causal)
        last = (n - 1).clamp(min=0) + torch.arange(b, device=slots.device) * q
        out = tuple(o[last] for o in self.step(ids, feat, pos, slots, plan))
        return out if then is None else tuple(then(out, Extended(ids[last], prefix, prefix_len + n, n > 0)))


@dataclass
class Extended:
    """What an extend leaves for a function run after it in its graph, per padded request [B]: its last row's
    token (the root, for EAGLE-3), its extended prefix [B, P] (the table's row) and length, whether it is real."""

    last_ids: torch.Tensor
    prefix: torch.Tensor
    prefix_len: torch.Tensor
    real: torch.Tensor


class HeldSlots:
    """Slots of a drafter's own KV pool held for good for a search's temporary K/V (its tree nodes'), as a
    [batch, width] table on the device that its graphs read: no alloc, free or upload per step (SGLang holds
    its draft tokens' slots the same way). A larger batch bucket or a wider search takes a new table (the old
    slots go back): pass `table` among the search's pools, so that graphs reading the old one are dropped."""

    def __init__(self, pool):
        self.pool = pool
        self.host: torch.Tensor | None = None
        self.table: torch.Tensor | None = None  # [batch, width] int64 on the pool's device

    def take(self, batch: int, width: int) -> torch.Tensor:
        """The table, at least [batch, width]: request i's node j writes slot table[i, j]."""
        t = self.table
        if t is None or t.shape[0] < batch or t.shape[1] < width:
            rows, cols = max(batch, 0 if t is None else t.shape[0]), max(width, 0 if t is None else t.shape[1])
            if self.host is not None:
                self.pool.free(self.host)
                self.host = self.table = None
            self.host = self.pool.alloc(rows * cols)
            self.table = to_device(self.host, self.pool.device).view(rows, cols)
        return self.table


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

    With request keys the prefixes are read from a slot table per plan on the device (models/slot_table.py;
    the runner's own, or a caller's that another graph keeps whole, as EAGLE-3's draft-extend does): the
    upload carries each request's row and what the rows lack (a fixed region of ROOM pairs per request),
    not the prefixes. A step's host values go up in one copy (one int64 buffer), each device input in one
    device copy; the outputs come back as the graph left them, for the padded batch [B, ...] (the real requests'
    rows first): views that the next replay overwrites, so a caller reads them before its next search (a
    drafted step's verify copies the trees into its own graph's buffers; SGLang's draft graph hands its outputs
    over the same way). The caller's function decides what a padded request computes; it must stay finite and
    apart."""

    ROOM = 8  # table pairs per request in a keyed step's upload (a verify step's accepted nodes fit)

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
        self.tables: dict[str, SlotTable] = {}  # the keyed plans' own tables (made on first use)
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

    def forget(self, key) -> None:
        """The request under `key` ended: its rows of the runner's own tables are free."""
        for t in self.tables.values():
            t.forget(key)

    def run(
        self,
        key,  # what else shapes the function (a tree shape): one graph per (bucket, key)
        search: SearchFn,
        rows: dict[
            str, "torch.Tensor | list[list[int]]"
        ],  # name -> [b, n] int64 host ints, or a host tensor [b, n] or [b*n]
        prefixes: dict[str, list[torch.Tensor]],  # name -> per request its committed slots [P_i] (host)
        inputs: dict[str, torch.Tensor],  # name -> [b, ...] on the device
        pools: tuple,  # the KV pools the search writes and reads (graphs bake their addresses in)
        keys: list | None = None,  # per request its key (a request id; forget() it when the request ends)
        tables: dict[str, SlotTable] | None = None,  # with keys: a caller's table for a plan (else the runner's)
        first: Rows | None = None,  # a row function the graph runs before the search (its fields in the upload)
        patch: tuple | None = None,  # (tag, fn(grids, lens, real)): in the graph after `first`, before the tables
        # are read, fn may rewrite the int grids and prefix lengths in place (a chained step's, from the device)
        extra: int = 0,  # columns a patch may add to a prefix (the bucket covers them)
    ) -> tuple[torch.Tensor, ...] | None:
        """search's outputs for the padded batch (the b real requests first; see the class docstring), or None
        when no bucket fits (the caller searches step by step)."""
        b = len(next(iter(rows.values())))  # (the first rows are [b, n]; a tensor's may be flat [b*n])
        bk = self.bucket_of(b, {n: max(p.numel() for p in pre) + extra for n, pre in prefixes.items()})
        if bk is None:
            return None
        self.bind(pools)
        held = {n: (tables or {}).get(n) or self.table(n) for n in prefixes} if keys is not None else {}
        self.runs += 1
        bb, plans = bk
        room = bb * self.ROOM
        # (name, n, host ints)
        widths = tuple(
            (n, len(r[0]) if isinstance(r, list) else r.numel() // b, isinstance(r, list)) for n, r in rows.items()
        )
        specs = tuple((n, tuple(x.shape[1:]), x.dtype) for n, x in inputs.items())
        device = self.cache.device
        pairs = {n: t.pending(keys, prefixes[n], room, self.cache.stream.launch) for n, t in held.items()}
        host = _search_host(bk, widths, b, rows, prefixes, pairs, room, first)
        first_shape = first.shape if first is not None else None

        def make() -> dict:
            blank = {n: ([], [], None, None) for n in held}
            blank_first = None if first is None else first.blank()
            bufs = {"longs": to_device(_search_host(bk, widths, 0, {}, {}, blank, room, blank_first), device)}
            for n, shape, dtype in specs:
                bufs[n] = torch.zeros(bb, *shape, dtype=dtype, device=device)
            return bufs

        def fill(bufs: dict) -> None:
            fill_flat(bufs["longs"], host)
            for n, x in inputs.items():
                bufs[n][:b].copy_(x)

        out = self.cache.run(
            (bk, widths, specs, tuple((n, id(t)) for n, t in held.items()), key, first_shape, patch and patch[0]),
            make,
            fill,
            lambda bufs: self._static(bk, widths, specs, held, bufs, search, first, patch and patch[1]),
        )
        for _, _, _, done in pairs.values():
            done()
        return tuple(out)

    def bind(self, pools: tuple) -> None:
        """The pools the next search writes and reads: other pools than the last search's drop its graphs and start
        its own tables over (their rows hold another pool's slots). A caller that appends to the tables before the
        search (a commit's cells) binds first, so that it appends to the tables the search reads."""
        if len(pools) != len(self._pools) or any(a is not c for a, c in zip(pools, self._pools)):
            self.cache.clear()
            self.tables = {}
            self._pools = tuple(pools)

    def table(self, name: str) -> SlotTable:
        """The runner's own slot table for plan `name` (made on first use)."""
        if name not in self.tables:
            self.tables[name] = SlotTable(2 * self.batch_buckets[-1] + 1, self.context[-1] + 1, self.cache.device)
        return self.tables[name]

    def _static(
        self, bk, widths, specs, held: dict, bufs: dict, search: SearchFn, first: Rows | None = None, patch=None
    ) -> tuple[torch.Tensor, ...]:
        """The captured function: the upload's views (see _search_host), `first`'s row function over its fields,
        the tables' pairs written and their rows read, the caller's search."""
        bb, plans = bk
        room, names = bb * self.ROOM, list(held)
        packed = [(n, p) for n, p in plans if n not in held]
        int_grids = [(n, w) for n, w, ints in widths if ints]
        tensor_grids = [(n, w) for n, w, ints in widths if not ints]
        r, fi, ft = first.shape if first is not None else (0, 0, 0)
        sizes = [*(x for _ in names for x in (bb, room)), *(bb for _ in plans), bb, *(bb * w for _, w in int_grids)]
        sizes += [fi * r, *(room for _ in names), *(bb * w for _, w in tensor_grids), *(bb * p for _, p in packed)]
        sizes.append(ft * r)
        parts = iter(bufs["longs"].split(sizes))
        table_rows = {n: (next(parts), next(parts)) for n in names}  # n -> (rows [B], the pairs' cells [room])
        lens = {n: next(parts) for n, _ in plans}
        real = next(parts) > 0
        grids = {n: next(parts).view(bb, w) for n, w in int_grids}
        first_ints = next(parts)
        *rest, first_tensors = parts
        parts = iter(rest)
        if first is not None:  # (before the tables' rows are read: it may append to them)
            first.fn(*first_ints.view(fi, r), *first_tensors.view(ft, r))
        if patch is not None:
            patch(grids, lens, real)
        for n in names:  # the pairs the rows lack, then the rows read
            held[n].table.view(-1).index_put_((table_rows[n][1],), next(parts))
        grids.update({n: next(parts).view(bb, w) for n, w in tensor_grids})
        prefixes = {n: (next(parts).view(bb, p), lens[n]) for n, p in packed}
        for n, p in plans:
            if n in held:
                prefixes[n] = (held[n].table[:, :p].index_select(0, table_rows[n][0]), lens[n])
        return tuple(search(SearchBuffers(grids, prefixes, {n: bufs[n] for n, _, _ in specs}, real)))


def _search_host(
    bk, widths, b: int, rows: dict, prefixes: dict, pairs: dict, room: int, first: Rows | None = None
) -> torch.Tensor:
    """Host side of a search bucket, one int64 tensor: [ints: per table plan (pairs: its rows [B], the pairs'
    table indices [room]) | per plan prefix_len [B] | real [B] | each row given as host ints [B*n] | first's
    host int fields [F*R] || tensors: per table plan its pairs' slots [room] | each row given as a tensor [B*n] |
    per packed plan prefix [B*P] | first's tensor fields [F*R]], the first b requests' values filled in, the
    rest 0 (a table plan's padding requests read the scratch row 0). The ints go in as one tensor."""
    bb, plans = bk
    pad = [0] * (bb - b)
    ints = []
    for n in pairs:
        r, at = pairs[n][0], pairs[n][1]
        ints += [*r, *pad, *at, *([0] * (room - len(at)))]
    ints += [x for n, _ in plans for x in ([p.numel() for p in prefixes[n]] if b else []) + pad]
    ints += [1] * b + pad
    for name, w, listed in widths:
        if listed:
            ints += [v for r in rows[name] for v in r] if b else []
            ints += pad * w
    if first is not None:
        ints += first.host_ints()
    tens = [torch.tensor(ints, dtype=torch.long)]
    tens += [pairs[n][2] if b else host_zeros(room) for n in pairs]
    for name, w, listed in widths:
        if not listed:
            tens.append((rows[name] if rows[name].dim() == 1 else rows[name].reshape(-1)) if b else host_zeros(0))
            if b < bb:
                tens.append(host_zeros((bb - b) * w))
    for name, p in plans:
        if name not in pairs:
            tens.append(padded_prefixes(prefixes.get(name, []) if b else [], bb, p)[0].view(-1))
    if first is not None:
        tens += first.host_tensors()
    return torch.cat(tens)


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
