"""A drafted step whose accept results stay on the device (SGLang's spec v2), for the overlapped loop
(serving/spec_step.py): step N+1's draft-extend, search and verify are issued before the host reads step N.

Step N's verify graph (`SpecVerify`, on the target's GraphRunner) leaves in `SpecFuture`, per request row i:

    lens[i]          its accepted path's length L (root + accepted drafts: the KV slots kept; tokens: drafts + bonus)
    tokens[i, :L]    the accepted drafts, then the bonus token (the next root)
    inputs[i, :L]    the path's nodes' tokens: the root, then the accepted drafts (the tokens whose K/V is kept)
    slots[i, :L]     the target KV slots of the path's nodes
    feats[i, :L]     the target's captured layers at the path's nodes, side by side [F] (a drafter's features)

and a [B, 2W + 1] result for the step's one device-to-host copy (per request its path nodes [W], its tokens [W]
and whether its tree was a faulty drafter's). Step N+1 reads the futures on the device, each request at its row of step
N (`prev`): its verify writes step N's accepted drafts' slots into the slot table after step N's root and its own
root after them (the prefix length base + L on the device; base: the committed tokens before step N, which the
host knows); the drafter's commit of the path takes W rows per request of which the first L are real (EAGLE-3's
draft-extend, `FutureExtendRunner`: tokens and features from the futures; MoA's commit rows: the path's node tokens
and target slots, drafters/moa_graphs.py), the rest padding (slot 0), and the search after it starts at the bonus.
A request with prev -1 starts a chain: its prefix is the host's (the rows it lacks written before the graph).
Padding requests (table row 0) write only the scratch cell and leave the futures as they are, so a capture's
padding batch changes nothing. A mixed batch (`mixed`: requests that draft beside requests that do not) has its own
graphs: the search's trees moved to their requests' rows and each other request's tree its root alone (the bonus
token at its row of the previous verify, or the host's token), then N - 1 padding nodes that no node sees; its path
is the root, and its futures and result rows are as any request's.

A verify for requests that ask for logprobs (`top`: K, the batch's widest top_logprobs rounded up to a power of two;
a graph per K) adds to each result row its path's logprobs, as verify.path_logprobs takes them in the ordinary step
(the log-softmax of each path row of the verify's logits, upcast to fp32): the path tokens' [W], the K likeliest's
[W * K] and their ids [W * K], the floats as their fp32 bits in the int64 row (`path_logprobs_of` reads them): still
one copy.

A verify with sampled requests in its batch (`sampling`) takes each request's parameters as inputs (a sampled flag,
temperature, top_k, top_p, its seed): the target's token at each node of a sampled request is its coupled sample
(sampling.coupled_tokens: argmax of log p + the noise of (seed, the node's position + 1), p under its parameters,
as verify.coupled_path takes it in the ordinary step), at a greedy request's the argmax, and the paths follow from
those tokens as greedy paths do from the argmax (greedy_rows). The graphs' key holds whether any row samples and
whether any filters (top_k / top_p: a sort of each row), never the parameters' values: a batch without sampled rows
replays the graph it replayed before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..device import to_device
from ..sampling import (
    TokenLogprob,
    bits_floats,
    coupled_tokens,
    float_bits,
    greedy_tokens,
    sampling_buffers,
    sampling_rows,
)
from ..tree import TreeBatch
from ..verify import greedy_rows
from .draft_graphs import ExtendRunner
from .graph_runner import GraphRunner, bucket, fill_flat
from .penalty_graphs import PenaltyRow, penalized_logits, penalty_buffers, penalty_inputs, penalty_state

WIDTH = 16  # path columns kept per request: a tree's depth + 1 at most


@dataclass
class SpecFuture:
    """A verify's accepted paths left on the device for the next step (see the module docstring)."""

    lens: torch.Tensor  # [Bmax] int64
    tokens: torch.Tensor  # [Bmax, WIDTH] int64
    inputs: torch.Tensor  # [Bmax, WIDTH] int64
    slots: torch.Tensor  # [Bmax, WIDTH] int64
    feats: torch.Tensor  # [Bmax, WIDTH, F]

    @classmethod
    def make(cls, rows: int, features: int, dtype: torch.dtype, device) -> "SpecFuture":
        z = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=device)  # noqa: E731
        feats = torch.zeros(rows, WIDTH, features, dtype=dtype, device=device)
        return cls(z(rows), z(rows, WIDTH), z(rows, WIDTH), z(rows, WIDTH), feats)


def spec_future(g: GraphRunner) -> SpecFuture:
    """The graph runner's futures (made once: graphs bake their addresses in)."""
    fut = getattr(g, "_spec_future", None)
    if fut is None:
        h = g.model.cfg.hidden_size * len(g.capture_layers)
        fut = g._spec_future = SpecFuture.make(g.batch_buckets[-1], h, g.model.dtype, g.model.device)
    return fut


def verify_bucket(g: GraphRunner, b: int, nodes: int, bases: list[int], width: int) -> tuple | None:
    """The (B, N, P) bucket of a spec verify (P covers base + width: a chained step's previous path), or None."""
    bb, p = bucket(b, g.batch_buckets), bucket(max(bases) + width, g.context)
    if bb is None or p is None or bb * nodes > g.max_rows or nodes < 2:
        return None
    return bb, nodes, p


def verify_spec(
    g: GraphRunner,
    packed: TreeBatch,  # the search's trees, the first of its padded batch
    finite: torch.Tensor,  # [] bool: the search's draft logits all finite
    out_slots: torch.Tensor,  # [b * N] int64 host ids, tree after tree
    prefixes: list[torch.Tensor],  # per request its committed slots before step N (host; `base` = their count)
    keys: list,
    prev: list[int] | None,  # per request its row in the previous spec verify, or -1 (None: a chain's first step)
    width: int,  # with prev: the previous paths' longest possible length (its trees' depth + 1)
    kv,
    mixed: tuple[list[int], list[int]] | None = None,  # (src, roots): root-only rows beside the trees
    top: int | None = None,  # K: the result rows carry their paths' logprobs and K likeliest (None: no logprobs)
    sampling: list[tuple[float, int, float, int]] | None = None,  # per request (temperature, top_k, top_p, seed)
    penalties: list[PenaltyRow | None] | None = None,  # per request its logits rules (None: raw logits)
):  # -> (captured {layer: [b*N, H]} views, result [b, R] view): read before the next replay (queue copies)
    """The spec verify (module docstring) on g's stream: one fill and one replay. Without `mixed`, request i's tree
    is packed's i-th; with it, src[i] is its tree's index in packed, or -1 for a root-only row (a request that does
    not draft: its N rows the root, at the prefix's end, then padding) whose root is the bonus token at its row of
    the previous verify, or roots[i] (host) where it has none. R: 2W + 1, and W * (1 + 2K) more with `top` (each K
    a graph of its own). sampling (None: every request greedy): each request's parameters, temperature 0 for a greedy
    one, seed an int64 (sampling.int64): its rows' tokens their coupled samples (sampling.coupled_tokens), in graphs
    of their own (two: with top_k / top_p in the batch or not). penalties (None, or None for every request: raw
    logits): each tree row's logits under its request's penalties and min_tokens (models/penalty_graphs.py), in
    graphs of their own."""
    n = packed.longs.shape[2]
    b = len(keys)
    bases = [t.numel() for t in prefixes]
    key = verify_bucket(g, b, n, bases, width if prev is not None else 0)
    if key is None or (mixed is None and key[0] != packed.longs.shape[0]):
        raise ValueError(f"a spec verify of {b} trees of {n} nodes after {max(bases)} tokens fits no bucket")
    bb = key[0]
    g._use_pool(kv)
    g.runs += 1
    fut, prev = spec_future(g), [-1] * b if prev is None else prev
    rows = _table_rows(g, keys, prefixes, prev)
    pad = [0] * (bb - b)
    flags = [] if mixed is None else [*mixed[0], *([-1] * (bb - b)), *mixed[1], *pad]
    host = torch.cat(
        [
            out_slots,
            torch.zeros((bb - b) * n, dtype=torch.long),
            torch.tensor([*rows, *pad, *bases, *pad, *prev, *([-1] * (bb - b)), *flags], dtype=torch.long),
        ]
    )
    samp, params = sampling_rows(sampling, bb, g.model.cfg.vocab_size)
    pen = None
    if penalties is not None and any(x is not None for x in penalties):
        pen = penalty_inputs(g, keys, rows, [x >= 0 for x in prev], penalties, bb)
    key = (*key, "spec" if mixed is None else "spec-mixed", top, samp, pen is not None)
    d = len(packed.trees)

    def make() -> dict:
        dev = g.model.device
        longs = torch.zeros(bb * n + (3 if mixed is None else 5) * bb, dtype=torch.long)
        longs[bb * n + 2 * bb : bb * n + 3 * bb] = -1
        bufs = {"longs": to_device(longs, dev), "finite": torch.ones((), dtype=torch.bool, device=dev)}
        bufs["tree"] = torch.zeros(bb, 6, n, dtype=torch.long, device=dev)
        bufs["tree"][:, [1, 4, 5]] = -1
        bufs["mask"] = torch.eye(n, dtype=torch.bool, device=dev).expand(bb, n, n).clone()
        if samp is not None:
            bufs["sampling"] = sampling_buffers(params, dev)
        if pen is not None:
            bufs["penalty"] = penalty_buffers(bb, dev)
        return bufs

    def fill(bufs: dict) -> None:
        fill_flat(bufs["longs"], host)
        if mixed is None:
            bufs["tree"].copy_(packed.longs)
            bufs["mask"].copy_(packed.mask)
        else:  # (the trees first; the graph puts each in its request's row)
            bufs["tree"][:d].copy_(packed.longs[:d])
            bufs["mask"][:d].copy_(packed.mask[:d])
        bufs["finite"].copy_(finite)
        if samp is not None:
            for buf, x in zip(bufs["sampling"], params):
                fill_flat(buf, x)
        if pen is not None:
            for buf, x in zip(bufs["penalty"], pen):
                fill_flat(buf, x)

    out, result = g.cache.run(key, make, fill, lambda bufs: _verify_fn(g, fut, key, bufs, kv))
    t = b * n
    return {l: h[:t] for l, h in out.captured.items()}, result[:b]


def _table_rows(g: GraphRunner, keys: list, prefixes: list[torch.Tensor], prev: list[int]) -> list[int]:
    """Each request's row of the slot table: a request with a row in the previous verify (prev >= 0) has its row
    there (the graph writes the cells that path adds); the others' rows catch up with their host prefixes first,
    the graph writing their roots."""
    table, rows = g._table, [0] * len(keys)
    chained = [i for i, p in enumerate(prev) if p >= 0]
    if chained:
        got = table.rows_of([keys[i] for i in chained])
        if got is None:
            raise ValueError("a chained spec verify of a request the slot table does not hold")
        for i, row in zip(chained, got):
            rows[i] = row
    fresh = [i for i, p in enumerate(prev) if p < 0]
    if fresh:
        got, lacking = table.catch_up([keys[i] for i in fresh], [prefixes[i] for i in fresh])
        if lacking is not None:
            g.stream.launch(table.write, lacking)
        for i, row in zip(fresh, got):
            rows[i] = row
            table.account(keys[i], prefixes[i].numel() + 1)  # (the graph writes its root at column base)
    return rows


def _verify_fn(g: GraphRunner, fut: SpecFuture, key: tuple, bufs: dict, kv):
    """The captured spec verify: the slot table's rows made whole from the previous step's futures, the forward,
    the greedy paths, the futures and the result (module docstring)."""
    b, n, p, kind, top, samp, pen = key
    mixed = kind == "spec-mixed"
    slots, rows, base, prev, *flags = bufs["longs"].split([b * n, b, b, b] + [b, b] * mixed)
    flat, width = g._table.table.view(-1), g._table.width
    has = prev >= 0
    pr = prev.clamp(min=0)
    lens = torch.where(has, fut.lens[pr], 0)
    j = torch.arange(WIDTH, device=slots.device)
    drafts = has[:, None] & (j >= 1) & (j < lens[:, None])  # step N's accepted drafts (its root is in already)
    cells = torch.where(drafts, (rows * width + base)[:, None] + j, 0)
    flat.index_put_((cells.view(-1),), torch.where(drafts, fut.slots[pr], 0).view(-1))
    prefix_len = base + lens
    grid = slots.view(b, n)
    flat.index_put_((rows * width + prefix_len,), torch.where(rows > 0, grid[:, 0], 0))  # this step's roots
    prefix = g._table.table[:, :p].index_select(0, rows)
    tree, mask, plain = bufs["tree"], bufs["mask"], None
    if mixed:
        plain = flags[0] < 0
        root = torch.where(has, fut.tokens[pr, (lens - 1).clamp(min=0)], flags[1])
        tree, mask = _with_roots(tree, mask, flags[0], plain, root, prefix_len)
    ids, pos = tree[:, 0].reshape(-1), tree[:, 2].reshape(-1)
    vocab = g.model.cfg.vocab_size
    tokens = ids.view(b, n)
    out = g.static_forward(ids, pos, slots, prefix, prefix_len, mask, kv)
    raw = logits = g.model.logits(out.hidden, fp32=False)
    grid_pos = pos.view(b, n)
    if pen:  # (each chained row's path of the step before: the futures as that step's verify left them)
        depth = grid_pos - grid_pos[:, :1]
        st = penalty_state(g)
        logits = penalized_logits(st, bufs["penalty"], rows, has, lens, fut.tokens[pr], tokens, mask, depth, raw)
    if samp is None:
        argmax = greedy_tokens(logits)
    else:  # (each sampled row's coupled sample of the token after its node, at the node's position + 1)
        flag, top_k, seed, temp, top_p = bufs["sampling"]  # [b] each
        node = lambda x: x.repeat_interleave(n)  # noqa: E731
        # the noise once per request and depth d < w (at the position root + 1 + d), as verify.coupled_path makes it
        w = min(n, WIDTH)
        depth = (grid_pos - grid_pos[:, :1]).clamp(0, w - 1)
        at = (torch.arange(b, device=pos.device)[:, None] * w + depth).view(-1)
        positions = (grid_pos[:, :1] + 1 + torch.arange(w, device=pos.device)).view(-1)
        args = (node(flag) > 0, node(temp), node(top_k), node(top_p), seed.repeat_interleave(w), positions, samp, at)
        argmax = coupled_tokens(logits, *args)
    nodes, path = greedy_rows(tokens, tree[:, 1], pos.view(b, n), tree[:, 4], tree[:, 5], argmax.view(b, n))
    bad = ((tokens < 0) | (tokens >= vocab)).any(1) | ~bufs["finite"]
    if plain is not None:  # (a root-only row drafted nothing: never a faulty drafter's)
        bad = bad & ~plain
    w = min(n, WIDTH)
    nodes, path = nodes[:, :w], path[:, :w]
    at = nodes.clamp(min=0)
    real = rows > 0
    keep = lambda dst, new: dst.copy_(torch.where(real.view(-1, *[1] * (new.dim() - 1)), new, dst))  # noqa: E731
    keep(fut.lens[:b], (nodes >= 0).sum(1))
    keep(fut.tokens[:b, :w], path)
    keep(fut.inputs[:b, :w], tokens.gather(1, at))
    keep(fut.slots[:b, :w], grid.gather(1, at))
    if g.capture_layers:  # (a drafter's features: EAGLE-3's; MoA reads the target's K/V at the slots instead)
        feats = torch.cat([out.captured[l] for l in g.capture_layers], -1).view(b, n, -1)
        keep(fut.feats[:b, :w], feats.gather(1, at[..., None].expand(b, w, feats.shape[2])))
    result = [nodes, path, bad.long()[:, None]]
    if top is not None:
        result += graph_path_logprobs(raw.view(b, n, -1), at, path, top)  # (the raw logits' logprobs, as Sampler's)
    return out, torch.cat(result, 1)


def graph_path_logprobs(
    logits: torch.Tensor,  # [B, N, V] the verify's, or a plain decode graph's (N 1) (the model's dtype)
    at: torch.Tensor,  # [B, W] each path's nodes (past its end: node 0)
    path: torch.Tensor,  # [B, W] its tokens (past its end: -1)
    k: int,
) -> list[torch.Tensor]:
    """[B, W] the path tokens' logprobs, [B, W * k] the k likeliest's, [B, W * k] their ids, all int64 (the
    floats' fp32 bits): verify.path_logprobs's values, for every row at once."""
    b, w = at.shape
    rows = torch.log_softmax(logits.gather(1, at[..., None].expand(b, w, logits.shape[2])).float(), dim=-1)
    chosen = rows.gather(2, path.clamp(min=0)[..., None])
    vals, ids = rows.topk(k, dim=-1)
    bits = lambda x: float_bits(x).view(b, -1)  # noqa: E731
    return [bits(chosen), bits(vals), ids.reshape(b, -1)]


def path_logprobs_of(
    row: list[int], width: int, top: int, tokens: list[int], k: int, at: int | None = None
) -> list[TokenLogprob]:
    """A spec verify's result row (read on the host; W = width, K = top) -> its path tokens' logprobs, each with
    its k likeliest (k <= K: the request's top_logprobs), as verify.to_host gives them for an ordinary step. at:
    where graph_path_logprobs' columns start in the row (None: the spec verify's, after its 2W + 1; a plain decode
    graph's row: 1, models/decode_graphs.py)."""
    n, at = len(tokens), 2 * width + 1 if at is None else at
    chosen, vals = bits_floats(row[at : at + n]), bits_floats(row[at + width : at + width + width * top])
    ids = row[at + width + width * top :]
    top_of = lambda i: tuple(zip(ids[i * top : i * top + k], vals[i * top : i * top + k]))  # noqa: E731
    return [TokenLogprob(t, chosen[i], top_of(i)) for i, t in enumerate(tokens)]


def _with_roots(
    tree: torch.Tensor,  # [B, 6, N] the search's trees first (TREE_LONGS)
    mask: torch.Tensor,  # [B, N, N]
    src: torch.Tensor,  # [B] each request's tree in them, or -1: a root-only row
    plain: torch.Tensor,  # [B] bool: src < 0
    root: torch.Tensor,  # [B] a root-only row's root token
    at: torch.Tensor,  # [B] its position (the prefix's length)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tree, mask) of a mixed batch: each request's tree moved to its row; a root-only row's N nodes its root then
    padding (token 0, no parent or children, each seeing itself only), at the root's position: its path the root,
    its token the target's there (the argmax or its coupled sample)."""
    b, _, n = tree.shape
    first = torch.arange(n, device=tree.device) == 0
    none = torch.full((b, n), -1, dtype=torch.long, device=tree.device)
    alone = torch.stack([torch.where(first, root[:, None], 0), none, at[:, None].expand(b, n), none + 1, none, none], 1)
    idx = src.clamp(min=0)
    tree = torch.where(plain[:, None, None], alone, tree.index_select(0, idx))
    eye = torch.eye(n, dtype=torch.bool, device=tree.device)
    return tree, torch.where(plain[:, None, None], eye, mask.index_select(0, idx))


class FutureExtendRunner(ExtendRunner):
    """ExtendRunner with `run_future`: a chained step's draft-extend, its rows' tokens, count and features from the
    previous spec verify's futures (module docstring)."""

    def run_future(
        self,
        keys: list,
        positions: list[int],  # [b * W] each request's rows' positions (its committed pairs + j)
        slots: torch.Tensor,  # [b * W] int64 host ids: the rows' slots (those past L never written)
        width: int,  # W: rows per request (the tree's depth + 1)
        prefixes: list[torch.Tensor],  # per request its processed pairs' slots (host)
        prev: list[int],  # per request its row in the previous spec verify
        fut: SpecFuture,
        pools: tuple,
        then: tuple,  # as ExtendRunner.run's
    ) -> tuple[torch.Tensor, ...] | None:
        """then's outputs for the padded batch [B, ...] (as the graph left them), or None when no bucket fits. The
        table's account of the rows is the caller's (SlotTable.account once L is read)."""
        b = len(keys)
        key = self.bucket_of([width] * b, [p.numel() for p in prefixes])
        if key is None or key[1] > WIDTH:
            return None
        if len(pools) != len(self._pools) or any(a is not c for a, c in zip(pools, self._pools)):
            self.cache.clear()
            self.table = self._new_table()
            self._pools = tuple(pools)
        consts = then[2]
        if any(c is not self._consts.get(i) for i, c in enumerate(consts)):
            self.cache.clear()
            self._consts = dict(enumerate(consts))
        self.runs += 1
        front = [0] * (b * width) + list(positions)
        longs, overflow, _ = self.table.inputs(key, keys, [width] * b, prefixes, front, [slots], True)
        if overflow is not None:
            self.cache.stream.launch(self.table.write, overflow)
        bb, device = key[0], self.cache.device
        prev_host = torch.tensor([*prev, *([-1] * (bb - b))], dtype=torch.long)

        def make() -> dict:
            q = key[1]
            return {
                "longs": torch.zeros(5 * bb * q + 2 * bb, dtype=torch.long, device=device),
                "prev": torch.full((bb,), -1, dtype=torch.long, device=device),
            }

        def fill(bufs: dict) -> None:
            fill_flat(bufs["longs"], longs)
            fill_flat(bufs["prev"], prev_host)

        fn = then[1]
        out = self.cache.run(
            (key, "future", id(fut), then[0]), make, fill, lambda bufs: self._extend_future(key, bufs, fut, fn)
        )
        return tuple(out)

    def _extend_future(self, key, bufs: dict, fut: SpecFuture, then) -> tuple[torch.Tensor, ...]:
        """The captured function: each request's first L rows real (the rest's slots zeroed before the table's
        append), their tokens and features from the futures, then ExtendRunner's pass."""
        b, q, _ = key
        s = b * q
        longs, prev = bufs["longs"], bufs["prev"]
        pr = prev.clamp(min=0)
        n = torch.where(prev >= 0, fut.lens[pr], 0)
        ar = torch.arange(q, device=prev.device)
        real = ar[None, :] < n[:, None]  # [B, Q]
        longs[:s].copy_(torch.where(real, fut.tokens[pr, :q], 0).view(-1))
        longs[2 * s : 3 * s].mul_(real.view(-1))
        ids, pos, slots, prefix, prefix_len = self.table.read(longs, key, append=True)
        feat = fut.feats[pr, :q].reshape(s, -1)
        return self._pass(key, ids, pos, slots, prefix, prefix_len, n, feat, ar, then)
