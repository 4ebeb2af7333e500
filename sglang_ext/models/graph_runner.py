"""CUDA graphs for the target's decode / verify forward (`GraphRunner`) at bucketed shapes, as SGLang's
cuda_graph_runner does, with the same static padded path run eagerly off CUDA; the buckets, the static plan and
attention, and the graph cache the drafters' runners (models/draft_graphs.py) share.

Why: on a GPU a small step is host-bound (one launch per op, ~300 per SmolLM2 forward); one graph
replay launches them all at once. A graph replays fixed shapes and fixed buffer addresses with no host
reads, so a step that runs in one is first put in a *static* form:

    bucket (B, Q, P): B requests (batch padded up), Q query rows each (tree nodes padded up), P prefix
    columns each (the request's committed KV slots, padded up to a context bucket)

    ids / positions / out_slots  [B*Q]    row b*Q + j = node j of request b; padding: token 0, position 0,
                                          K/V written to slot 0 (the pool's scratch slot, never handed out)
    prefix                       [B, P]   committed slots (padding -> slot 0), prefix_len [B] real columns
    tree_mask                    [B, Q, Q] node j sees node i; a padded row sees only itself

and attention reads the K/V of [prefix | the request's own Q rows] through that table, masked on the
device from prefix_len and tree_mask (`static_plan`; the columns in the eager plan's order, padding
last). A real row never sees a padded column (masked to -inf, weight exactly 0), so padding changes no
real row's output; padded rows' outputs are dropped. `static_attention` is, on CUDA, the eager Triton
kernel in its padded form: a real row streams the same columns in the same blocks as eagerly, so a
replayed graph gives the eager forward's bits (greedy tokens do not depend on graphs, batch or bucket);
elsewhere the torch reference's batched matmuls.

Host data goes into the bucket's static buffers in one copy per dtype before the replay; the replay's
outputs are gathered to the real rows (a copy, so the next replay cannot overwrite what the caller kept).
With request keys (the engine's steps), the prefixes are not in that copy: the runner keeps every request's
slots in a table on the device (SGLang's req_to_token; models/slot_table.py) and the copy carries only what
the table's rows lack, written by the graph before it reads them. A plain decode step's graph also takes its
logits and its tokens (models/decode_graphs.py: one upload in, the tokens out, and the tokens left on the device in
the runner's `_future` for the next decode step's rows to read, the overlapped loop's future tokens).

A drafter's step and its whole search are the same idea (models/draft_graphs.py: FrontierRunner,
SearchRunner).

Off CUDA (or with graphs off) the runners run the same static path eagerly, which is how their
padding, bucketing and buffer logic is tested on the CPU. Graphs are captured lazily, one per bucket
on its first use (a warmup on a side stream, then the capture into one memory pool per runner, shared
by its buckets: one replay's outputs are copied out before the next replay).
Outside the buckets (prefill and mixed steps, bigger batches or trees, longer contexts) the caller
runs the eager forward.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

import torch

from .. import kernels
from ..device import Stream, default_stream, to_device
from ..sampling import greedy_tokens
from ..tree import TokenTree, TreeBatch
from ..verify import GreedyRows, greedy_rows
from .kv_pool import KVPool
from .llama import ForwardOutput, LlamaModel
from .slot_table import SlotTable
from .slot_table import real_rows as _real_rows

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
NODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MIN_CONTEXT_BUCKET = 128  # context buckets: powers of two from this up to the model's context
MAX_ROWS = 2048  # B*Q above this runs eagerly: bs 64 with a verify tree of up to 32 nodes fits (off CUDA the
# static torch attention holds B*Q x heads x K fp32 scores: ~300 MB at 2048 rows, 9 heads, a 4k context)


@dataclass
class StaticPlan:
    """A padded batch's attention inputs, built on the device inside the graph (once per forward). Each
    request's columns are in the eager plan's order, [its committed prefix | its extra slots], padding
    after them, so a kernel that streams a request's columns in order reads a real row's columns in
    the same blocks as the eager forward does (tree_attention_static: bit for bit)."""

    slots: torch.Tensor  # [B, K] int64: pool slots of request b's columns (padding: slot 0)
    allowed: torch.Tensor  # [B, Q, K] bool: row j of request b reads column c
    kv_len: torch.Tensor  # [B] int64: the columns before request b's padding (prefix_len + E)

    @cached_property
    def streams(self):
        """Each row's visible columns in order (the Triton kernel's input), once per forward."""
        from ..attention.triton_tree import row_streams_padded

        return row_streams_padded(self.allowed)


def static_plan(prefix: torch.Tensor, prefix_len: torch.Tensor, extra: torch.Tensor, extra_mask: torch.Tensor):
    """prefix [B, P] slots every row of request b may read below prefix_len [B]; extra [B, E] slots read
    under extra_mask [B, Q, E] (tree nodes). Device ops only, fixed shapes (K = P + E columns)."""
    b, q, e = extra_mask.shape
    p = prefix.shape[1]
    cols = torch.arange(p + e, device=prefix.device)
    rel = cols[None, :] - prefix_len[:, None]  # [B, K]: column c is extra slot c - prefix_len when in [0, E)
    in_prefix, in_extra = rel < 0, (rel >= 0) & (rel < e)
    ei = rel.clamp(0, e - 1)
    from_prefix = (
        prefix.gather(1, cols.clamp(max=max(p - 1, 0))[None, :].expand(b, -1)) if p else prefix.new_zeros(b, e)
    )
    slots = torch.where(in_prefix, from_prefix, torch.where(in_extra, extra.gather(1, ei), 0))
    seen_extra = extra_mask.gather(2, ei[:, None, :].expand(b, q, -1))
    allowed = in_prefix[:, None, :] | (in_extra[:, None, :] & seen_extra)
    return StaticPlan(slots, allowed, prefix_len + e)


def static_attention(
    q: torch.Tensor,  # [B*Q, Hq, D] rows request-major
    k_pool: torch.Tensor,  # [S, Hkv, D]
    v_pool: torch.Tensor,  # [S, Hkv, D]
    plan: StaticPlan,
    scale: float,
) -> torch.Tensor:  # [B*Q, Hq, D]
    """Attention over a StaticPlan: on CUDA the Triton tree kernel in its padded form (the eager
    default there, so a replayed graph computes what the eager forward does); elsewhere the torch
    reference's batched matmuls over the same plan (same math, summation order aside)."""
    if kernels.on_gpu(q):
        from ..attention.triton_tree import tree_attention_static

        return tree_attention_static(q, k_pool, v_pool, plan.slots, plan.allowed, plan.kv_len, scale, plan.streams)
    b, qm, k = plan.allowed.shape
    hq, d = q.shape[1], q.shape[2]
    hkv = k_pool.shape[1]
    rep = hq // hkv
    qb = q.reshape(b, qm, hkv, rep, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, rep * qm, d)
    kb = k_pool[plan.slots].transpose(1, 2)  # [B, Hkv, K, D]
    vb = v_pool[plan.slots].transpose(1, 2)
    s = torch.matmul(qb, kb.transpose(-1, -2)).float().mul_(scale)  # [B, Hkv, rep*Q, K]
    hidden = ~plan.allowed[:, None, None]
    s = s.view(b, hkv, rep, qm, k).masked_fill_(hidden, float("-inf")).view(b, hkv, rep * qm, k)
    p = s.softmax(-1).to(vb.dtype)
    out = torch.matmul(p, vb).view(b, hkv, rep, qm, -1).permute(0, 3, 1, 2, 4)
    return out.reshape(b * qm, hq, -1)


def with_static_attention(model: LlamaModel) -> LlamaModel:
    """The same model (weights shared, not copied) attending with `static_attention`."""
    m = copy.copy(model)
    m.attention = static_attention
    return m


def bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= n, or None when n exceeds them all."""
    return next((x for x in buckets if x >= n), None)


def context_buckets(max_context: int, smallest: int = MIN_CONTEXT_BUCKET) -> tuple[int, ...]:
    """Powers of two from `smallest`, the last one covering max_context."""
    out = [smallest]
    while out[-1] < max_context:
        out.append(out[-1] * 2)
    return tuple(out)


class GraphCache:
    """Per bucket key: static input buffers and, with graphs on, the graph captured over them and its
    outputs. Without graphs the same function runs eagerly on the same buffers. Device work goes on `stream`
    (sglang_ext.device: the device's own by default): the fills are issued on it, then the replay."""

    def __init__(self, device: torch.device, graphs: bool, stream: Stream | None = None):
        self.device = torch.device(device)
        self.stream = stream if stream is not None else default_stream(self.device)
        self.graphs = graphs and self.stream.graphs
        self.entries: dict[Any, tuple[dict, Any, Any]] = {}  # key -> (buffers, graph or None, outputs)
        self.pool = None  # one CUDA memory pool shared by every graph (they never run at once)

    def clear(self) -> None:
        self.entries.clear()

    def run(self, key, make_buffers: Callable[[], dict], fill: Callable[[dict], None], fn: Callable[[dict], Any]):
        """fill(buffers) copies this call's inputs into the key's buffers; fn(buffers) is the computation
        (captured once per key, then replayed)."""
        if key not in self.entries:
            bufs = make_buffers()  # padding everywhere: a valid input to capture over
            graph, out = None, None
            if self.graphs:
                graph, out, self.pool = self.stream.capture(fn, bufs, self.pool)
            self.entries[key] = (bufs, graph, out)
        bufs, graph, out = self.entries[key]
        self.stream.launch(fill, bufs)
        if graph is None:
            return fn(bufs)
        graph.replay()
        return out


def fill_flat(buf: torch.Tensor, host: torch.Tensor) -> None:
    """buf (a static device buffer) <- host, queued (pinned) when buf is on a GPU."""
    buf.copy_(to_device(host, buf.device), non_blocking=True)


class GraphRunner:
    """The target's forward over a batch of requests, each with `q_lens[b]` new rows (a decode token or
    a verify tree) after a committed prefix, at a bucketed static shape: replayed from a CUDA graph on
    CUDA with graphs on, else the same static path run eagerly. Same outputs as `model.forward` with
    the request's plan (up to the attention's summation order)."""

    def __init__(
        self,
        model: LlamaModel,
        capture_layers: tuple[int, ...] = (),
        graphs: bool = True,
        batch_buckets: tuple[int, ...] = BATCH_BUCKETS,
        node_buckets: tuple[int, ...] = NODE_BUCKETS,
        context: tuple[int, ...] | None = None,
        max_rows: int = MAX_ROWS,
        stream: Stream | None = None,
    ):
        """context: prefix-length buckets (default: powers of two up to the model's context); stream: where the
        device work goes (default: the model's device's, sglang_ext.device.default_stream)."""
        for name, b in (("batch", batch_buckets), ("node", node_buckets)):
            if not b or list(b) != sorted(set(b)) or b[0] < 1:
                raise ValueError(f"{name} buckets must be increasing positive ints, got {b!r}")
        self.model = model
        # the same model (weights shared) with the static attention: its forward is the captured function
        self._static_model = with_static_attention(model)
        self.capture_layers = tuple(capture_layers)
        self.batch_buckets, self.node_buckets = tuple(batch_buckets), tuple(node_buckets)
        self.context = tuple(context) if context else context_buckets(model.cfg.max_position)
        self.max_rows = max_rows
        self.cache = GraphCache(model.device, graphs, stream)
        self._kv: KVPool | None = None
        self._table: SlotTable | None = None  # the keyed requests' slots on the device (made on first use)
        self._future: torch.Tensor | None = None  # [max batch] int64: the last decode step's tokens (decode_graphs)
        self.runs = 0  # forwards this runner took (the rest of a caller's steps ran eagerly)

    @property
    def stream(self) -> Stream:
        return self.cache.stream

    @property
    def graphs(self) -> bool:
        """Whether steps replay CUDA graphs (else the static path runs eagerly)."""
        return self.cache.graphs

    def bucket_of(self, q_lens: list[int], prefix_lens: list[int]) -> tuple[int, int, int] | None:
        """The (B, Q, P) bucket of a batch (q_lens[b] new rows after prefix_lens[b] committed tokens),
        or None when it fits none (the caller runs the eager forward)."""
        if not q_lens or len(q_lens) != len(prefix_lens) or min(q_lens) < 1:
            return None
        b = bucket(len(q_lens), self.batch_buckets)
        q = bucket(max(q_lens), self.node_buckets)
        p = bucket(max(prefix_lens), self.context)
        if b is None or q is None or p is None or b * q > self.max_rows:
            return None
        return b, q, p

    def can_run(self, q_lens: list[int], prefix_lens: list[int]) -> bool:
        return self.bucket_of(q_lens, prefix_lens) is not None

    def run(
        self,
        ids: list[torch.Tensor],  # per request [n_b] token ids
        positions: list[torch.Tensor],  # per request [n_b]
        out_slots: list[torch.Tensor],  # per request [n_b] where each row's K/V is written
        prefixes: list[torch.Tensor],  # per request [P_b] committed slots every row reads
        tree_masks: list[torch.Tensor],  # per request [n_b, n_b] bool: row j sees row i
        kv: KVPool,
        keys: list[Hashable] | None = None,
        trees: list[TokenTree] | None = None,
    ):  # ForwardOutput: rows of all requests, flat, request-major (as model.forward's); with trees, (it, GreedyRows)
        """keys: per request a key whose prefix only grows, by appending, while the runner knows it (a
        decoding request's id; `forget` it when the request ends): the prefixes are then read from the
        runner's slot table on the device (models/slot_table.py), and only what its rows lack goes up.
        trees (with keys; the requests' trees, whose tokens and positions `ids` and `positions` are): the graph
        also takes the logits, their argmax and each tree's greedy path (verify.GreedyRows)."""
        if trees is not None and keys is None:
            raise ValueError("greedy paths inside the graph (trees) need request keys")
        if trees and trees[0].batch is not None and trees[0].batch.holds(trees):
            out = self._verify_packed(trees[0].batch, out_slots, prefixes, kv, keys)
            if out is not None:
                return out
        q_lens = [t.numel() for t in ids]
        key = self.bucket_of(q_lens, [p.numel() for p in prefixes])
        if key is None:
            raise ValueError(f"batch (rows {q_lens}, prefixes {[p.numel() for p in prefixes]}) fits no graph bucket")
        for n, t in zip(q_lens, tree_masks):
            if tuple(t.shape) != (n, n):
                raise ValueError(f"tree mask of shape {tuple(t.shape)} for {n} rows")
        self._use_pool(kv)
        self.runs += 1
        b, q, p = key
        device = self.model.device
        # the real rows of the flat [B*Q] buffers, request after request: with every request filling its Q rows
        # (plain decode, a search's trees) the first T (slices: nothing to copy up), else host ints (one copy up)
        dense = all(n == q for n in q_lens)
        rows = None if dense else to_device(torch.tensor(_real_rows(q_lens, q), dtype=torch.long), device)
        # tokens, positions and masks built on the device (a drafter's trees) are placed there, never read back
        host = all(t.device.type == "cpu" for t in (*ids, *positions, *tree_masks))
        args = (ids, positions, tree_masks) if host else (None, None, None)
        done = None
        if keys is None:
            longs, mask = _host_inputs(key, q_lens, out_slots, prefixes, *args)
            fn = lambda bufs: self._forward(key, bufs, kv)  # noqa: E731
        else:
            key = (*key, "table" if trees is None else "verify")
            vals = [*ids, *positions, *out_slots] if host else list(out_slots)
            longs, done = self._keyed_inputs(key, keys, q_lens, prefixes, [], vals)
            # (device trees' masks go over the padding, reset on the device from the bucket's template)
            mask = _padding(q, 0)[0].expand(b, q, q).clone() if q > 1 and host else None
            if mask is not None:
                _masks_into(mask, list(tree_masks))
            fn = lambda bufs: self._forward_keyed(key, bufs, kv)  # noqa: E731

        def fill(bufs: dict) -> None:
            fill_flat(bufs["longs"], longs)
            # (a one-node bucket's mask is its padding, made with the buffers: each row sees itself)
            if q > 1 and mask is not None:
                fill_flat(bufs["mask"], mask)
            elif q > 1:
                bufs["mask"].copy_(bufs["padding"])
            if not host:
                _place(bufs, key, rows, ids, positions, tree_masks)
            if trees is not None:
                _place_trees(bufs["tree"], rows, trees)

        out = self.cache.run(key, lambda: self._buffers(key), fill, fn)
        if done is not None:
            done()
        if trees is not None:
            return self._greedy_out(out, rows, len(ids), sum(q_lens))
        if dense:  # copies (the next replay overwrites the graph's outputs)
            t = sum(q_lens)
            return ForwardOutput(out.hidden[:t].clone(), {l: h[:t].clone() for l, h in out.captured.items()})
        return ForwardOutput(out.hidden[rows], {l: h[rows] for l, h in out.captured.items()})

    def _verify_packed(
        self,
        packed: TreeBatch,  # the requests' trees, the first b of a search's padded batch of B
        out_slots: list[torch.Tensor],  # per request [N] host ids
        prefixes: list[torch.Tensor],
        kv: KVPool,
        keys: list[Hashable],
    ):  # (ForwardOutput, GreedyRows), or None when the batch fits no bucket of its shape (run's other paths)
        """A verify of one search's trees (run with trees that `packed` holds) in the bucket (B, N, P, "packed"):
        B the search's padded batch, N its trees' nodes (no node padding: every row real, its padding requests'
        trees those the search left them, their K/V written to the scratch slot). Its inputs: the upload of the
        slots (and what the slot table lacks), and the batch's two tensors in one device copy each; the outputs
        are views of the graph's (read before the next run: the step's verify, accept and commit do)."""
        bb, _, n = packed.longs.shape
        b = len(packed.trees)
        p = bucket(max(t.numel() for t in prefixes), self.context)
        if bucket(b, self.batch_buckets) != bb or p is None or bb * n > self.max_rows:
            return None
        self._use_pool(kv)
        self.runs += 1
        key = (bb, n, p, "packed")
        longs, done = self._keyed_inputs(key, keys, [n] * b, prefixes, [], list(out_slots))

        def fill(bufs: dict) -> None:
            fill_flat(bufs["longs"], longs)
            bufs["tree"].copy_(packed.longs)
            bufs["mask"].copy_(packed.mask)

        out = self.cache.run(key, lambda: self._buffers(key), fill, lambda bufs: self._forward_keyed(key, bufs, kv))
        done()
        fwd, logits, argmax, nodes, tokens, bad = out
        t = b * n
        hidden = ForwardOutput(_first(fwd.hidden, t), {l: _first(h, t) for l, h in fwd.captured.items()})
        return hidden, GreedyRows(
            _first(logits, t), _first(argmax, t), _first(nodes, b), _first(tokens, b), _first(bad, b)
        )

    def forget(self, key: Hashable) -> None:
        """The request under `key` ended: its slot table row is free."""
        if self._table is not None:
            self._table.forget(key)

    def _use_pool(self, kv: KVPool) -> None:
        if kv is not self._kv:  # graphs bake the pool's addresses in: a new pool needs new graphs (and slots)
            self.cache.clear()
            self._kv = kv
            self._table = None
        if self._table is None:
            rows = 2 * self.batch_buckets[-1] + 1
            self._table = SlotTable(rows, self.context[-1] + 1, self.model.device)
            self._future = torch.zeros(self.batch_buckets[-1], dtype=torch.long, device=self.model.device)

    def _keyed_inputs(self, key, keys, q_lens, prefixes, front, vals):
        """(the keyed bucket's flat host inputs, done()): the pairs that do not fit the upload go into the
        table now (outside the graph)."""
        longs, overflow, done = self._table.inputs(key[:3], keys, q_lens, prefixes, front, vals)
        if overflow is not None:
            self.stream.launch(self._table.write, overflow)
        return longs, done

    def _buffers(self, key: tuple) -> dict:
        """A bucket's static inputs, holding an all-padding batch (a keyed bucket's: see slot_table)."""
        longs, mask = _host_inputs(key[:3], [], [], [])
        dev = self.model.device
        if len(key) > 3:
            b, q, _ = key[:3]
            longs = torch.zeros(5 * b * q + 2 * b, dtype=torch.long)
        bufs = {"longs": to_device(longs, dev), "mask": to_device(mask, dev)}
        if len(key) > 3 and key[1] > 1 and key[3] != "packed":  # (the padding mask, for device trees' masks to go over)
            bufs["padding"] = bufs["mask"].clone()
        if key[-1] == "verify":  # the trees' parents, next-token and next-sibling lists [3, B*Q] (padding: -1)
            bufs["tree"] = torch.full((3, key[0] * key[1]), -1, dtype=torch.long, device=dev)
        if key[-1] == "packed":  # a search's padded batch (tree_batch's longs [B, 6, N] and masks [B, N, N])
            bufs["tree"] = torch.zeros(key[0], 6, key[1], dtype=torch.long, device=dev)
            bufs["tree"][:, [1, 4, 5]] = -1  # (until the first fill: root-only trees, as the padding of "verify")
        return bufs

    def _greedy_out(self, out, rows: torch.Tensor | None, n: int, t: int):
        """A verify bucket's outputs at the real rows: (ForwardOutput, GreedyRows) (see run). The forward's rows
        are copies (a drafter keeps captured rows past the step); GreedyRows' are views where they can be, read
        within the step (the next replay overwrites them)."""
        fwd, logits, argmax, nodes, tokens, bad = out
        pick = (lambda x: x[:t]) if rows is None else (lambda x: x[rows])
        keep = (lambda x: x[:t].clone()) if rows is None else pick
        fwd = ForwardOutput(keep(fwd.hidden), {l: keep(h) for l, h in fwd.captured.items()})
        return fwd, GreedyRows(pick(logits), pick(argmax), nodes[:n], tokens[:n], bad[:n])

    def _forward_keyed(self, key: tuple, bufs: dict, kv: KVPool):
        """The captured function of a keyed bucket: the table's rows made whole and read, the static plan, the
        model's forward; a "verify" or "packed" bucket's also each tree's greedy path -> (output, logits, argmax,
        nodes, tokens, bad) (a "packed" bucket's tokens, positions and tree lists from its batch of trees, not from
        the upload). (A "greedy" bucket's: models/decode_graphs.py.)"""
        b, q, p = key[:3]
        ids, pos, slots, prefix, prefix_len = self._table.read(bufs["longs"], key[:3])
        if key[3] == "packed":  # (tree_batch's rows: TREE_LONGS)
            tree = bufs["tree"]
            ids, pos = tree[:, 0].reshape(-1), tree[:, 2].reshape(-1)
        tokens = ids.view(b, q)  # (the drafts as drafted: one outside the vocabulary is never accepted)
        out = self.static_forward(ids, pos, slots, prefix, prefix_len, bufs["mask"], kv)
        if key[3] == "table":
            return out
        logits = self.model.logits(out.hidden, fp32=False)
        argmax = greedy_tokens(logits)
        if key[3] == "packed":
            parents, nxt, sib = bufs["tree"][:, 1], bufs["tree"][:, 4], bufs["tree"][:, 5]
        else:
            parents, nxt, sib = bufs["tree"].view(3, b, q).unbind(0)
        nodes, path_tokens = greedy_rows(tokens, parents, pos.view(b, q), nxt, sib, argmax.view(b, q))
        bad = ((tokens < 0) | (tokens >= self.model.cfg.vocab_size)).any(1)
        return out, logits, argmax, nodes, path_tokens, bad

    def _forward(self, key: tuple[int, int, int], bufs: dict, kv: KVPool) -> ForwardOutput:
        """The captured function: views of the flat buffers, the static plan, the model's forward."""
        b, q, p = key
        ids, pos, slots, prefix, prefix_len = bufs["longs"].split([b * q, b * q, b * q, b * p, b])
        return self.static_forward(ids, pos, slots, prefix.view(b, p), prefix_len, bufs["mask"], kv)

    def static_forward(
        self,
        ids: torch.Tensor,  # [B*Q] int64 the rows' tokens
        pos: torch.Tensor,  # [B*Q] int64
        slots: torch.Tensor,  # [B*Q] int64 where each row's K/V goes
        prefix: torch.Tensor,  # [B, P] int64 each request's committed slots
        prefix_len: torch.Tensor,  # [B] int64
        mask: torch.Tensor,  # [B, Q, Q] bool the rows' own mask
        kv: KVPool,
    ) -> ForwardOutput:
        """Inside a captured function: the static plan and the model's forward of the rows."""
        plan = static_plan(prefix, prefix_len, slots.view(prefix.shape[0], -1), mask)
        # NOTE: a faulty drafter's token outside the vocabulary must not index past the embedding (on a GPU,
        # a device-side assert); clamped here, inside the replay, it costs no launch of its own (verification
        # never accepts such a token)
        ids = ids.clamp(0, self.model.cfg.vocab_size - 1)
        return self._static_model.forward(ids, pos, slots, plan, kv, self.capture_layers)


def _first(x: torch.Tensor, n: int) -> torch.Tensor:
    """x's first n rows (x itself when it has n: no op)."""
    return x if x.shape[0] == n else x[:n]


def _place(bufs: dict, key, rows: torch.Tensor | None, ids, positions, tree_masks) -> None:
    """Tokens, positions and tree masks (per request, wherever they are) into a bucket's buffers on
    their device by device copies, a fixed number of ops for the batch: rows [T] the flat rows they fill
    (see _host_inputs' layout); None: the first T (every request fills its Q rows)."""
    b, q = key[0], key[1]
    device = bufs["longs"].device
    vals = torch.cat([to_device(t, device) for t in (*ids, *positions)])  # [2T]: every id, then every position
    if rows is None:
        t = vals.numel() // 2
        bufs["longs"][: 2 * b * q].view(2, b * q)[:, :t] = vals.view(2, t)
    else:
        bufs["longs"][torch.cat([rows, rows + b * q])] = vals
    _masks_into(bufs["mask"], tree_masks)


def _place_trees(dst: torch.Tensor, rows: torch.Tensor | None, trees: list[TokenTree]) -> None:
    """The trees' parents, next-token and next-sibling lists into a verify bucket's buffer dst [3, B*Q] (rows:
    as _place's) by device copies, a fixed number of ops for the batch."""
    dev = dst.device
    fields = (lambda t: t.parents, lambda t: t.retrieve_next_token, lambda t: t.retrieve_next_sibling)
    vals = torch.cat([to_device(f(t), dev) for f in fields for t in trees]).view(3, -1)  # [3, T]
    if rows is None:  # (every request fills its Q rows: nothing of an earlier step's trees is left in them)
        dst[:, : vals.shape[1]] = vals
    else:  # (a request's rows past its tree must hold padding, not an earlier step's larger tree)
        dst.fill_(-1)[:, rows] = vals


def _masks_into(dst: torch.Tensor, masks: list[torch.Tensor]) -> None:
    """Request i's tree mask [n_i, n_i] into dst[i, :n_i, :n_i] (dst [B, Q, Q] bool, holding padding: each
    row sees itself). A one-node tree's mask is that padding already (its node sees itself): left as it is.
    Masks of one size (a search's trees) go in with one copy; mixed sizes one copy per mask."""
    at = [i for i, m in enumerate(masks) if m.shape[0] > 1]
    if not at:
        return
    n = masks[at[0]].shape[0]
    if any(masks[i].shape[0] != n for i in at):
        for i in at:
            k = masks[i].shape[0]
            dst[i, :k, :k] = to_device(masks[i], dst.device)
        return
    stacked = torch.stack([to_device(masks[i], dst.device) for i in at])  # [len(at), n, n]
    if at == list(range(at[0], at[0] + len(at))):
        dst[at[0] : at[0] + len(at), :n, :n] = stacked
    else:
        dst[to_device(torch.tensor(at, dtype=torch.long), dst.device), :n, :n] = stacked


def _host_inputs(
    key, q_lens: list[int], out_slots, prefixes, ids=None, positions=None, tree_masks=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The host side of a bucket's buffers: one int64 tensor [ids | positions | out_slots | prefix |
    prefix_len] and the tree mask [B, Q, Q], padding as the module docstring says; ids, positions and
    tree_masks None: left as padding (the caller places them on the device). A fixed number of host ops
    for the batch: the bucket's padding cloned, the rows' values and prefix lengths in one scatter at
    host-computed indices, the prefixes in one boolean-mask scatter."""
    b, q, p = key
    n = len(q_lens)
    pad_mask, cols = _padding(q, p)
    longs, mask = torch.zeros(3 * b * q + b * p + b, dtype=torch.long), pad_mask.expand(b, q, q).clone()
    if not n:
        return longs, mask
    vals = [*ids, *positions, *out_slots] if ids is not None else list(out_slots)
    first = 3 - len(vals) // n  # the first grid filled: 0 (ids) or 2 (out_slots)
    pre_lens = [t.numel() for t in prefixes]
    at = [x for k in range(first, 3) for x in _real_rows(q_lens, q, k * b * q)]  # grid k's real rows
    at += range(3 * b * q + b * p, 3 * b * q + b * p + n)  # prefix_len's first n
    longs[torch.tensor(at, dtype=torch.long)] = torch.cat([*vals, torch.tensor(pre_lens, dtype=torch.long)])
    if sum(pre_lens):
        prefix = longs[3 * b * q : 3 * b * q + b * p].view(b, p)
        within = cols < torch.tensor([[x] for x in pre_lens], dtype=torch.long)  # [n, P] request i's columns
        (prefix if n == b else prefix[:n])[within] = torch.cat(list(prefixes)) if n > 1 else prefixes[0]
    if tree_masks is not None:
        _masks_into(mask, list(tree_masks))
    return longs, mask


@lru_cache(maxsize=64)
def _padding(q: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's padding tree mask [Q, Q] (each row sees itself) and prefix columns arange(P), for a
    bucket's host inputs: templates, never written (callers copy)."""
    return torch.eye(q, dtype=torch.bool), torch.arange(p)


# step(ids [R], feat [R, H] | None, rows {name: [R] int64}, plans {name: StaticPlan}) -> tensors [R, ...]
