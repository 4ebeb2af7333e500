"""EAGLE-3 drafter: one draft layer over fused target features, with its own KV cache.

Pairs. The draft processes pair s = (token s+1, feature of token s) at RoPE position s; the
feature is fc(target layers' outputs) for verified tokens, or for tree nodes the draft's own
pre-norm output of the parent node (as EAGLE-3 does at inference and in training-time test):

    verified:   tokens  x0  x1  x2  x3 | root r          features f0 f1 f2 f3 (from the target)
    pairs:      (x1,f0) (x2,f1) (x3,f2) (r,f3)  -> draft KV slots, kept
    tree:       depth-1 nodes (d, out(r,f3)) at position 4, depth-2 at 5, ...  -> temporary slots

Cache. Verified pairs are processed lazily at the next propose (the root token is known only
then), so the draft KV only ever holds verified pairs; the tree's speculative K/V is freed after
every propose, i.e. the cache is rolled back to the accepted path by construction.

Prefix cache. The draft KV of pair s depends on tokens 0..s+1, so it is kept beside the engine's prefix cache
under the target's slot of token s+1 (drafters/kept.py): a hit on m tokens adopts pairs 0..m-2 and processes
only the pairs from m-1 on, the first from token m-1's features (the engine keeps the target layers' outputs of
cached tokens: TargetCapture.cached_hidden).
"""

from __future__ import annotations

import os
from dataclasses import replace
from itertools import accumulate
from pathlib import Path

import torch

from ..attention import FrontierPaths, advance_seen, causal_masks, plan_flat, plan_frontier, tree_attention_cpu
from ..device import grow, module_on, rejoin, upload
from ..kernels import attach_bf16_halves, attach_q8, q8_eagle3_layer, q8_of
from ..models.checkpoint import check_fits
from ..models.draft_graphs import FrontierRunner, HeldSlots, SearchBuffers, SearchRunner
from ..models.eagle3 import Eagle3Draft, load_eagle3
from ..models.graph_runner import GraphCache, static_attention, static_plan
from ..models.kv_pool import KVPool
from ..models.llama import LlamaModel
from ..models.spec_graphs import WIDTH, FutureExtendRunner, SpecFuture
from ..settings import settings
from ..tree import TokenTree, TreeShape, search_candidates, tree_batch, unpack_trees
from .base import Drafter, DrafterError, DraftInput, TargetCapture
from .kept import KeptState, keep_or_free
from .search import Finite, one_level, root_children, scatter_to_vocab, search_tree, top_k_search
from .shipped import shipped_path


def default_checkpoint(target) -> Path:
    """$MOA_SERVE_EAGLE3 if set, else the EAGLE-3 head shipped in drafters/ for this target."""
    return shipped_path(target, "eagle3", env=settings().eagle3)


class _RequestState:
    def __init__(self):
        self.slots = torch.empty(0, dtype=torch.long)  # draft KV of processed pairs
        # unprocessed pairs' features, in order: the target's captured layers {layer: [m, Ht]} of verified
        # tokens (fused at the next propose, the whole batch's in one call), or fused [m, H] (an edge client's)
        self.pending: list[dict[int, torch.Tensor] | torch.Tensor] = []
        self.borrowed = 0  # leading pairs adopted from the kept state (never freed by the request)
        self.future: torch.Tensor | None = None  # a chained step's pairs' slots [W], until its path is read


class Eagle3Drafter(Drafter):
    name = "eagle3"
    keeps_prefix_state = True  # processed pairs of prefix-cached tokens, by target slot
    captures_steps = True
    chains = True  # a greedy static search's step chains in the overlapped loop (propose_chained)
    edge = edge_client_ready = True  # an edge client gets the fused features of verified tokens
    kv_only_rows = 8  # pairs before each request's last from which an extend (a prompt's) takes them K/V alone
    commits_roots = True  # a step without drafting: its roots' captured rows in one call

    def __init__(self, target: LlamaModel, draft: Eagle3Draft, num_slots: int = 32768):
        c = draft.cfg
        check_fits(c, target.cfg)
        self.target = target
        self.draft = module_on(draft, target.device, target.dtype).eval()  # beside the target
        if target.device.type == "cpu":  # (the CPU kernels' weights; a GPU runs the checkpoint's dtype)
            attach_bf16_halves(self.draft)  # a bf16 checkpoint: its matmuls read half the bytes, same sums
        # beside a q8 target: the matmuls on its kernels, the layer in one call; every weight (layer, fc, head) as Q4_1
        # blocks, as the target's layers: a step of a few rows streams them from memory, ~35 % fewer bytes than Q8_0
        # (the head as Q4_1: tau 1.426 vs 1.430 on six sets x 2 prompts, 1.063x vanilla vs 1.040x, 2 threads)
        self.q8_layer = None
        if target.device.type == "cpu" and target.q8 is not None:
            attach_q8(self.draft, "Q4_1")
            self.q8_layer = q8_eagle3_layer(self.draft, "Q4_1")
        self.capture_layers = tuple(c.aux_layers)
        self.kv = KVPool(1, num_slots, c.num_kv_heads, c.head_dim, target.dtype, target.device)
        self.kept = KeptState((self.kv,))  # pairs of prefix-cached tokens, under their input token's target slot
        self.hot_ids = self.draft.hot_ids
        self.scale = c.head_dim**-0.5
        self.reqs: dict[int, _RequestState] = {}
        # frontier steps at bucketed static shapes (CUDA graphs on CUDA); the engine turns this on with
        # its cuda_graphs setting. Deterministic searches only: sampled chains need full-vocab logits.
        self.step_graphs = False
        self._steps: FrontierRunner | None = None
        self._search: SearchRunner | None = None  # the whole search in one static function (one graph)
        self._held: HeldSlots | None = None  # its temporary slots, held for good
        # the draft-extend of verified pairs (one graph), its requests' slots in a table on the device
        self._extender: FutureExtendRunner | None = None

    @classmethod
    def from_target(cls, target, path: str | os.PathLike | None = None) -> "Eagle3Drafter":
        ckpt = Path(path) if path else default_checkpoint(target)
        return cls(target.model, load_eagle3(ckpt, target.cfg, dtype=target.model.dtype))

    # --- lifecycle ----------------------------------------------------------------------------
    def add_request(self, rid: int, capture: TargetCapture) -> None:
        st = self.reqs[rid] = _RequestState()
        if capture.cached:  # pair s is kept under token s + 1's slot: pairs 0..cached-2 may be kept
            (st.slots,) = self.kept.adopt(capture.slots[1 : capture.cached])
            st.borrowed = st.slots.numel()
            # the pairs from `borrowed` on need the features of cached tokens borrowed..cached-1 (one, when all kept)
            if capture.cached_hidden is None:
                raise DrafterError("a prefix cache hit without the captured layers of its cached tokens")
            older = capture.cached_hidden(st.borrowed)
            capture = replace(capture, hidden={l: torch.cat([older[l], h]) for l, h in capture.hidden.items()})
        self.commit(rid, capture)

    def _layers_of(self, hidden: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """The draft's captured layers of a capture (one without them fails here, on its requests)."""
        if missing := [l for l in self.capture_layers if l not in hidden]:
            raise DrafterError(f"target capture lacks layers {missing}")
        return {l: hidden[l] for l in self.capture_layers}

    @torch.inference_mode()
    def commit(self, rid: int, capture: TargetCapture) -> None:  # (fused at the next propose: _RequestState.pending)
        self.reqs[rid].pending.append(self._layers_of(capture.hidden))

    def commit_roots(self, rids: list[int], captured: dict[int, torch.Tensor]) -> None:
        rows = self._layers_of(captured).items()
        for i, rid in enumerate(rids):  # (commit's pending item: each layer's row of the root, a view)
            self.reqs[rid].pending.append({l: h[i : i + 1] for l, h in rows})

    def context(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """Fused features [n, H] of newly verified tokens (also what an edge server sends a client)."""
        h = self._layers_of(hidden)  # (a layer may be two of the three: each in its place)
        return self.draft.fuse(torch.cat([h[l] for l in self.capture_layers], dim=-1).to(self.target.dtype))

    def edge_context(self, kv, slots, positions, hidden: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"features": self.context(hidden)}

    def ingest_context(self, rid: int, tokens: list[int], positions: torch.Tensor, ctx: dict) -> None:
        """Edge client: fused features of verified tokens, computed by the server."""
        self.reqs.setdefault(rid, _RequestState()).pending.append(ctx["features"].to(self.target.dtype))

    def remove_request(self, rid: int) -> None:
        self._forget(rid)
        st = self.reqs.pop(rid, None)
        if st is not None:
            self.drop_chained_state(st)
            self.kv.free(st.slots[st.borrowed :])

    def release_request(self, rid: int, taken: torch.Tensor) -> None:
        """The request ended; taken[i]: the target slot where the prefix cache holds its token i, or -1. A processed
        pair is kept under its input token's slot (pair s: token s + 1's) when the cache holds that token."""
        self._forget(rid)
        st = self.reqs.pop(rid, None)
        if st is not None:
            self.drop_chained_state(st)
            keep_or_free(self.kept, [st.slots], st.borrowed, taken[1:])

    def drop_prefix(self, slots: torch.Tensor) -> None:
        self.kept.drop(slots)

    def _forget(self, rid: int) -> None:
        for runner in (self._extender, self._search):
            if runner is not None:
                runner.forget(rid)

    # --- drafting -----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, batch: list[DraftInput], shape: TreeShape) -> list[TokenTree]:
        # NOTE: deterministic (top-k) search runs over the draft vocab and maps ids back at the end;
        # sampled chains need q over the target vocab for verification, so they get full-vocab logits.
        full = shape.topk == 1 and any(not d.params.greedy for d in batch)
        # the whole search as one graph replay; on the CPU with min_prob the eager search stops early and
        # drops the nodes below it (trees of other sizes than a static search's), so it runs step by step
        searchable = self.step_graphs and not full and (not shape.min_prob or self.target.device.type != "cpu")
        extended = self._extend(batch, shape if searchable else None)
        if isinstance(extended, list):  # (the draft-extend and the whole search in one graph: the trees)
            return extended
        root_out = extended  # [b, H]
        head = q8_of(self.draft.lm_head) if not full and not searchable and one_level(shape, root_out.device) else None
        if head is not None:  # the head's norm, matmul, softmax and top-k in one call (the step's caches are cold)
            top_p, top_ids, ok = head.norm_topk(
                root_out, self.draft.norm.weight.detach(), self.draft.norm.eps, shape.topk
            )
            return root_children(top_p, self.hot_ids[top_ids], shape, batch, ok.all())
        b = len(batch)
        to_logits = self._full_logits if full else (lambda out: self.draft.logits(out).float())
        to_target = (lambda ids: ids) if full else (lambda ids: self.hot_ids[ids])
        prefixes = [self.reqs[d.rid].slots for d in batch]
        if searchable:
            trees = self._static_search(batch, shape, root_out, prefixes)
            if trees is not None:
                return trees
        # the search in flight: the frontier's pre-norm outputs [b, q, H] and each node's path (device)
        state = {"out": root_out[:, None], "paths": FrontierPaths.start(b, root_out.device)}
        temp: list[torch.Tensor] = []

        def step_fn(tokens: torch.Tensor, parent_beam: torch.Tensor | None) -> torch.Tensor:
            kk = tokens.shape[1]
            out = state["out"]
            if parent_beam is None:  # the root's children
                feat = out.expand(b, kk, -1)
            else:
                feat = torch.gather(out, 1, parent_beam[..., None].expand(b, kk, out.shape[-1]))
            new = self.kv.alloc(b * kk)
            temp.append(new)
            paths = state["paths"].advance(new, parent_beam)
            # every node of this step is at depth len(temp): pair position seq_len - 1 + depth
            pos = torch.tensor([d.seq_len - 1 + len(temp) for d in batch]).repeat_interleave(kk)
            ids, feat = to_target(tokens.reshape(-1)), feat.reshape(b * kk, -1)
            static = self._frontier(ids, feat, pos, new, prefixes, paths) if self.step_graphs and not full else None
            if static is None:
                out = self._layer(ids, feat, pos, new, plan_frontier(prefixes, paths.slots, paths.seen))
                logits = to_logits(out)  # (each node: prefix + its own path)
            else:
                out, logits = static
            state["out"], state["paths"] = out.view(b, kk, -1), paths
            return logits.view(b, kk, -1)

        try:
            trees = search_tree(to_logits(root_out), step_fn, shape, batch)
        finally:
            for t in temp:  # speculative draft K/V is never kept
                self.kv.free(t)
        if not full:
            for t in trees:
                t.draft_tokens = torch.cat([t.draft_tokens[:1], self.hot_ids[t.draft_tokens[1:]]])
        return trees

    def _extend(self, batch: list[DraftInput], shape: TreeShape | None = None) -> torch.Tensor | list[TokenTree]:
        """Process every request's pending verified pairs; return the root pair's output [b, H]. The
        batch's pairs go through one fuse, one slot allocation, one mask and one layer pass (eager: the pairs before
        each request's last through the layer's K/V alone first). shape (a static search's): on the static path the
        search runs in the extend's graph, and its trees come back instead."""
        sts = [self.reqs[d.rid] for d in batch]
        done = [st.slots.numel() for st in sts]
        m = [sum(_rows(p) for p in st.pending) for st in sts]
        for d, st, n, k in zip(batch, sts, done, m):
            if not st.pending or n + k != d.seq_len:
                raise DrafterError(
                    f"request {d.rid}: draft state out of sync ({n} pairs + pending vs {d.seq_len} verified tokens)"
                )
        items = [p for st in sts for p in st.pending]
        static = self.step_graphs and all(isinstance(p, dict) for p in items)  # (an edge client's fused ones: eager)
        fused = None if static else self._pending_features(items)  # [sum m, H]
        old = [st.slots for st in sts]
        new = self._take_pending(sts, m)
        if static:
            out = self._static_extend(batch, done, m, old, new, items, shape)
            if out is not None:
                return out
            fused = self._pending_features(items)
        slots = [st.slots for st in sts]
        # host values in one tensor's pieces: the pairs' token ids and positions, each request's last pair (its
        # root), the one-call layer's qo / kv indptr
        ids = [t for d, n, k in zip(batch, done, m) for t in d.token_ids[n + 1 : n + 1 + k]]
        pos = [j for n, k in zip(done, m) for j in range(n, n + k)]
        roots = [x - 1 for x in accumulate(m)]
        qo, kv = [0, *accumulate(m)], [0, *accumulate(s.numel() for s in slots)]
        pieces = [ids, pos, roots, qo, kv]
        ids, pos, last_h, qo, kv = torch.tensor([x for p in pieces for x in p]).split([len(p) for p in pieces])
        ids, last = upload([ids, last_h], fused.device)  # (one copy where the draft runs elsewhere)
        if len(ids) - len(batch) >= self.kv_only_rows:
            # only each request's last pair's output is read (the root of its search; the layer is the draft's only
            # one): the pairs before it need their K/V alone (a prompt's first extend: 4x less time at 800 tokens,
            # no attention over the prompt), and the last pairs run the whole layer over their full prefixes. A
            # step's few accepted pairs run the whole layer: the second call and its ops cost more than the rows
            self._kv_only(ids, fused, pos, new)
            ids, fused, pos, new = ids[last], fused[last], pos[last_h], new[last_h]
            done, m, qo = [n + k - 1 for n, k in zip(done, m)], [1] * len(batch), torch.arange(len(batch) + 1)
        masks = causal_masks(m, done)
        if self.q8_layer is not None:  # the ragged fields the one-call layer reads, without plan_flat's buckets
            out = self._layer(ids, fused, pos, new, (qo, kv, torch.cat(slots), masks))
        else:
            out = self._layer(ids, fused, pos, new, plan_flat(slots, masks, m))
        return out if len(ids) == len(batch) else out[last]

    def _kv_only(self, ids: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """The draft layer's K/V of rows (token ids [n], fused features [n, H], positions [n]) into `slots` [n]:
        what _layer writes for them, without their attention and MLP."""
        if self.q8_layer is not None:
            cos, sin = self.draft.rope(positions, torch.float32)
            x = (self.target.embed[ids], feat.contiguous())
            self.q8_layer.draft_kv(*x, 0, cos[:, 0], sin[:, 0], slots, self.kv.k[0], self.kv.v[0])
            return
        _, k, v = self.draft.qkv(self.target.embed[ids], feat, positions)
        self.kv.write(0, slots, k, v)

    def _take_pending(self, sts: list[_RequestState], m: list[int]) -> torch.Tensor:
        """Slots for the requests' pending pairs (m[i] each), appended to their slot lists; [sum m] host ids."""
        new = self.kv.alloc(sum(m))
        for st, s in zip(sts, grow([st.slots for st in sts], list(new.split(m)))):
            st.slots, st.pending = s, []
        return new

    def _static_extend(self, batch, done, m, old, new, items, shape=None) -> torch.Tensor | list[TokenTree] | None:
        """The pending pairs through the extend runner (one graph; prefixes from its table on the device): each
        request's root pair's output [b, H] (shape given: the search in the same graph, its trees), or None when
        no bucket fits. old: the requests' slots before them."""
        bk = self._extend_runner().bucket_of(m, [s.numel() for s in old])
        if bk is None:
            return None
        # (each layer's rows of the step's commits: one gather's rows, split per request; rejoined without a copy)
        raw = [rejoin([h[l] for h in items]) for l in self.capture_layers]
        feat = torch.cat(raw, dim=-1)  # [sum m, layers * Ht], as context() fuses them
        ids = [t for d, n, k in zip(batch, done, m) for t in d.token_ids[n + 1 : n + 1 + k]]
        pos = [j for n, k in zip(done, m) for j in range(n, n + k)]
        feat = feat if feat.dtype == self.target.dtype else feat.to(self.target.dtype)
        then = None
        if shape is not None:  # the search after it, each root from its last pair (the request's last token)
            then = self._then_search(shape, bk[0])
        out = self._extender.run([d.rid for d in batch], ids, pos, new, m, old, feat, (self.kv,), then)
        if then is None:
            return out[0]
        longs, mask, scores, finite = out
        return unpack_trees(longs, mask, scores, finite, len(batch))

    def _extend_runner(self) -> FutureExtendRunner:
        if self._extender is None:

            def step(ids, feat, pos, slots, plan):
                return (self._layer(ids, self.draft.fuse(feat), pos, slots, plan, static_attention),)

            self._extender = self._on_stream(FutureExtendRunner(step, self.target.device, self.target.cfg.max_position))
        return self._extender

    def _then_search(self, shape: TreeShape, bb: int) -> tuple:
        """ExtendRunner's `then` for the search after a draft-extend of a padded batch of bb requests."""
        held = self._held_slots().take(bb, (shape.depth - 1) * shape.topk)

        def search(last, e):
            bufs = SearchBuffers(
                {"root": torch.stack([e.last_ids, e.prefix_len], 1)},
                {"draft": (e.prefix, e.prefix_len)},
                {"out": last[0]},
                e.real,
            )
            return self._search_fn(bufs, shape, held)

        return shape, search, (held,)

    # --- chained steps: the overlapped loop's (serving/spec_step.py, models/spec_graphs.py) ----------------------
    def use_stream(self, stream) -> None:
        """The drafter's graphs go on `stream` (the target's: the overlapped loop orders them with its verify)."""
        self.stream = stream
        for runner in (self._steps, self._search, self._extender):
            self._on_stream(runner)

    def _on_stream(self, runner):
        if runner is not None and self.stream is not None and runner.cache.stream is not self.stream:
            runner.cache = GraphCache(runner.cache.device, True, self.stream)
        return runner

    def chain_fits(self, rids: list[int], shape: TreeShape, chained: bool) -> bool:
        """Whether a chained step's draft (chained: W = depth + 1 rows per request from the futures; else each
        request's pending pairs) and search replay from one graph (ExtendRunner's buckets)."""
        cpu_min_prob = shape.min_prob and self.target.device.type == "cpu"  # (see propose: the eager search)
        if not self.step_graphs or cpu_min_prob or shape.depth + 1 > WIDTH or any(r not in self.reqs for r in rids):
            return False
        sts = [self.reqs[r] for r in rids]
        if chained:
            m = [shape.depth + 1] * len(sts)
        elif all(st.pending and all(isinstance(p, dict) for p in st.pending) for st in sts):
            m = [sum(_rows(p) for p in st.pending) for st in sts]
        else:
            return False
        return self._extend_runner().bucket_of(m, [st.slots.numel() for st in sts]) is not None

    @torch.inference_mode()
    def propose_chained(self, batch: list[DraftInput], shape: TreeShape, fut: SpecFuture, prev: list[int]):
        """The trees of a chained step: each request's pairs of the previous step's accepted path (read from `fut`
        at its row `prev`, their W = depth + 1 slots taken now, kept once the path is read: commit_chained), then
        the search, in one graph."""
        sts, w = [self.reqs[d.rid] for d in batch], shape.depth + 1
        old = [st.slots for st in sts]
        new = self.kv.alloc(len(batch) * w)
        for st, s in zip(sts, new.split(w)):
            st.future = s
        ext = self._extend_runner()
        try:
            bk = ext.bucket_of([w] * len(batch), [o.numel() for o in old])
            positions = [o.numel() + j for o in old for j in range(w)]
            rids = [d.rid for d in batch]
            out = ext.run_future(rids, positions, new, w, old, prev, fut, (self.kv,), self._then_search(shape, bk[0]))
        except BaseException:
            for st in sts:
                self.drop_chained_state(st)
            raise
        return unpack_trees(*out, len(batch))

    def commit_chained(self, rid: int, n: int, slots: torch.Tensor | None = None) -> None:
        """The previous step's path is read: the first n of its pairs' slots are the request's (the rest freed).
        (slots: the path's target slots, which EAGLE-3 does not keep.)"""
        st = self.reqs[rid]
        if st.future is not None:
            (st.slots,) = grow([st.slots], [st.future[:n]])
            self.kv.free(st.future[n:])
            st.future = None
            self._extender.table.account(rid, st.slots.numel())

    def drop_chained(self, rid: int, committed: int = 0) -> None:
        """The request ended before a chained step of its was read: that step's pairs' slots go back, the last
        `committed` of its slots too (that step's real pairs, committed when the step before it was read)."""
        st = self.reqs.get(rid)
        if st is not None:
            self.drop_chained_state(st)
            if committed:
                self.kv.free(st.slots[-committed:])
                st.slots = st.slots[:-committed]

    def drop_chained_state(self, st: "_RequestState") -> None:
        if st.future is not None:
            self.kv.free(st.future)
            st.future = None

    @torch.inference_mode()
    def settle(self, batch: list[DraftInput]) -> None:
        """Each request's pending pairs but its last (the root pair: the first output token with the prompt's last
        feature) through the draft-extend's graph, the search left out, as many rows a replay as its buckets take;
        its next step's commit takes the pair left, chained (join_chained: from the futures) or not (_extend).
        Requests whose pending pairs are not all captured layers, or whose pairs fit no bucket, stay as they were."""
        todo = []
        for d in batch:
            st = self.reqs[d.rid]
            if st.future is None and st.pending and all(isinstance(p, dict) for p in st.pending):
                h = {l: torch.cat([p[l] for p in st.pending]) for l in self.capture_layers}  # [m, Ht] each
                if _rows(h) > 1:
                    todo.append((d, st, h, st.slots.numel()))  # (its pairs' first: `base`)
        ext = self._extend_runner() if todo and self.step_graphs else None
        if ext is None:
            return
        q = ext.node_buckets[-1]
        while todo:  # (a round: each request's next q pairs at most, from its pairs processed so far)
            got = [(d, st, h, base, st.slots.numel() - base) for d, st, h, base in todo]
            m = [min(q, _rows(h) - 1 - k) for *_, h, _, k in got]
            if ext.bucket_of(m, [st.slots.numel() for _, st, *_ in got]) is None:
                break
            for (_, st, h, _, k), n in zip(got, m):
                st.pending = [{l: x[k : k + n] for l, x in h.items()}]
            self._extend(
                [replace(d, token_ids=d.token_ids[: base + k + n + 1]) for (d, _, _, base, k), n in zip(got, m)]
            )
            todo = [(d, st, h, base) for (d, st, h, base, k), n in zip(got, m) if k + n < _rows(h) - 1]
            for _, st, h, base, _ in got:
                st.pending = [{l: x[st.slots.numel() - base :] for l, x in h.items()}]  # (what is left)

    def joins(self, rid: int) -> bool:
        st = self.reqs.get(rid)
        one = st is not None and st.future is None and len(st.pending) == 1 and isinstance(st.pending[0], dict)
        return one and _rows(st.pending[0]) == 1

    @torch.inference_mode()
    def join_chained(self, batch: list[DraftInput], fut: SpecFuture, rows: list[int]) -> int:
        """Each request's one pending pair (`joins`: its root pair) written at its row of the futures as a path of
        one node (its token the root, its features the pair's): the chained draft-extend commits it as it commits a
        path, and the search starts there. -> 1 (one real row each)."""
        sts = [self.reqs[d.rid] for d in batch]
        feats = [torch.cat([st.pending[0][l] for l in self.capture_layers], -1) for st in sts]  # each [1, F]
        for st in sts:
            st.pending = []
        at = torch.tensor(rows, dtype=torch.long)
        roots = torch.tensor([d.token_ids[-1] for d in batch], dtype=torch.long)

        def write(at, roots, feats) -> None:
            at, roots = at.to(fut.lens.device), roots.to(fut.lens.device)
            fut.lens[at] = 1
            fut.tokens[at, 0] = roots
            fut.feats[at, 0] = torch.cat(feats).to(fut.feats.dtype)

        self.stream.launch(write, at, roots, feats)
        return 1

    def _pending_features(self, items: list) -> torch.Tensor:
        """Fused features [sum m, H] of pending items in order: the captured ones fused in one call."""
        raw = [p for p in items if isinstance(p, dict)]
        if not raw:
            return torch.cat(items)
        hidden = {l: raw[0][l] if len(raw) == 1 else torch.cat([h[l] for h in raw]) for l in self.capture_layers}
        fused = self.context(hidden)
        if len(raw) == len(items):
            return fused
        pieces = iter(fused.split([_rows(h) for h in raw]))
        return torch.cat([next(pieces) if isinstance(p, dict) else p for p in items])

    def _layer(
        self,
        ids: torch.Tensor,
        feat: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        plan,
        attention=tree_attention_cpu,
    ) -> torch.Tensor:
        """Draft layer over flat rows; writes their K/V to `slots`; returns pre-norm outputs [n, H]. plan: an
        AttentionPlan, or for the one-call layer its ragged fields (qo_indptr, kv_indptr, kv_indices, custom_mask)."""
        if self.q8_layer is not None and attention is tree_attention_cpu:
            cos, sin = self.draft.rope(positions, torch.float32)
            kv = (self.kv.k[0], self.kv.v[0])
            p = plan if isinstance(plan, tuple) else (plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.custom_mask)
            x = (self.target.embed[ids], feat.contiguous())
            return self.q8_layer.draft_layer(*x, 0, cos[:, 0], sin[:, 0], slots, *kv, *p, self.scale)
        q, k, v = self.draft.qkv(self.target.embed[ids], feat, positions)
        self.kv.write(0, slots, k, v)
        return self.draft.finish(attention(q, self.kv.k[0], self.kv.v[0], plan, self.scale), feat)

    def _frontier(self, ids, feat, pos, slots, prefixes, paths: FrontierPaths) -> tuple[torch.Tensor, ...] | None:
        """A frontier step (pre-norm outputs [n, H], draft-vocab logits [n, Vd]) from the step runner, or
        None when its buckets do not fit (the caller runs the eager step)."""
        if self._steps is None:

            def step(ids, feat, rows, plans):
                out = self._layer(ids, feat, rows["positions"], rows["slots"], plans["draft"], static_attention)
                return out, self.draft.logits(out).float()

            self._steps = self._on_stream(FrontierRunner(step, self.target.device, self.target.cfg.max_position))
        rows = {"positions": pos, "slots": slots}
        return self._steps.run(ids, feat, rows, {"draft": (prefixes, paths.slots, paths.seen)}, (self.kv,))

    def _static_search(
        self,
        batch: list[DraftInput],
        shape: TreeShape,
        root_out: torch.Tensor,
        prefixes: list[torch.Tensor],
    ) -> list[TokenTree] | None:
        """The deterministic search's trees from the search runner (root_out [b, H]: each root pair's
        output; the prefixes read from the draft-extend's slot table on the device, which a static extend left
        whole), the same trees as the step-by-step search; None when no bucket fits. Every step's
        temporary slots are the search's held slots (HeldSlots: request i's row, step after step)."""
        if self._search is None:
            self._search = self._on_stream(SearchRunner(self.target.device, self.target.cfg.max_position))
        bk = self._search.bucket_of(len(batch), {"draft": max(p.numel() for p in prefixes)})
        if bk is None:
            return None
        held = self._held_slots().take(bk[0], (shape.depth - 1) * shape.topk)
        out = self._search.run(
            shape,
            lambda bufs: self._search_fn(bufs, shape, held),
            {"root": [[d.token_ids[-1], d.seq_len] for d in batch]},  # [b, 2] (host ints)
            {"draft": prefixes},
            {"out": root_out},
            (self.kv, held),
            [d.rid for d in batch],
            {"draft": self._extender.table} if self._extender is not None else None,
        )
        longs, mask, scores, finite = out
        return unpack_trees(longs, mask, scores, finite, len(batch))

    def _held_slots(self) -> HeldSlots:
        if self._held is None:
            self._held = HeldSlots(self.kv)
        return self._held

    def _search_fn(self, bufs: SearchBuffers, shape: TreeShape, held: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The captured search over a padded batch of B requests (held: the held slots' table): the root's top-k,
        depth - 1 frontier steps (each node's path mask grown on the device, its K/V written at its held slot), the
        trees packed (tree_batch) with target ids. Outputs: longs [B, 6, N], tree_mask [B, N, N],
        scores [B, N], finite [] bool (every real request's draft logits finite)."""
        root_out = bufs.inputs["out"]  # [B, H]
        bb, h = root_out.shape
        prefix, prefix_len = bufs.prefixes["draft"]
        roots, seq_lens = bufs.rows["root"].unbind(1)
        temp = held[:bb, : (shape.depth - 1) * shape.topk]  # [B, (depth-1)*k]
        state = {"out": root_out[:, None], "seen": torch.zeros(bb, 1, 0, dtype=torch.bool, device=root_out.device)}

        def step_fn(tokens: torch.Tensor, parent_beam: torch.Tensor | None) -> torch.Tensor:
            kk, out = tokens.shape[1], state["out"]
            if parent_beam is None:  # the root's children
                feat = out.expand(bb, kk, h)
            else:
                feat = torch.gather(out, 1, parent_beam[..., None].expand(bb, kk, h))
            seen = advance_seen(state["seen"], parent_beam, kk)  # [B, kk, E]: the step's nodes are the last kk
            e = seen.shape[2]
            # every node of this step is at depth e // kk: pair position seq_len - 1 + depth
            pos = (seq_lens - 1 + e // kk)[:, None].expand(bb, kk).reshape(-1)
            plan = static_plan(prefix, prefix_len, temp[:, :e], seen)
            ids = self.hot_ids[tokens.reshape(-1)]
            out = self._layer(
                ids, feat.reshape(bb * kk, h), pos, temp[:, e - kk : e].reshape(-1), plan, static_attention
            )
            state["out"], state["seen"] = out.view(bb, kk, h), seen
            return self.draft.logits(out).float().view(bb, kk, -1)

        finite = Finite(per_request=True)
        search = top_k_search(self.draft.logits(root_out).float(), step_fn, shape.topk, shape.depth, 0.0, finite)
        top, draft, scores, parent_flat = search_candidates(search, shape.num_draft_tokens)
        keep = scores >= shape.min_prob if shape.min_prob > 0 else None
        trees = tree_batch(roots, top, self.hot_ids[draft], scores, parent_flat, seq_lens, keep)
        return (*trees, (finite.flag | ~bufs.real).all())  # (padding requests aside)

    def _full_logits(self, out: torch.Tensor) -> torch.Tensor:
        return scatter_to_vocab(self.draft.logits(out).float(), self.hot_ids, self.draft.cfg.vocab_size)


def _rows(pending: dict[int, torch.Tensor] | torch.Tensor) -> int:
    """Pairs in a pending item (captured layers or fused features)."""
    return next(iter(pending.values())).shape[0] if isinstance(pending, dict) else pending.shape[0]
