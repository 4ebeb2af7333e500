"""MoA's static paths: what a GPU replays as CUDA graphs, run eagerly on the same buffers off CUDA (models/
draft_graphs.py). MoADrafter (drafters/moa.py) takes them in when the engine turns its graphs on (`step_graphs`):

    _static_commit   the queued verified tokens' commit (their LSA memory, CA and SA K/V) as one row function
                     (RowRunner: each token alone), their slots appended to the search's slot tables: run first in
                     the search's graph, or alone (one graph per row bucket) where the search runs otherwise
    _static_search   the roots' pass and every search step in one graph per bucket (SearchRunner), its prefixes
                     read from those slot tables on the device, its SA temporaries at slots held for good
    _static_pass     one draft pass through the step runner (FrontierRunner), where the whole search fits no bucket

A chained step (the overlapped loop's: serving/spec_step.py, models/spec_graphs.py) commits the previous step's
accepted path from the device: W = depth + 1 rows a request, the first L real (their tokens and target slots from
the futures), the rest padding; the search after it starts at the bonus token, its prefixes L longer on the device.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..attention import advance_seen, plan_frontier
from ..device import grow, rejoin
from ..models.draft_graphs import FrontierRunner, HeldSlots, SearchBuffers, SearchRunner
from ..models.graph_runner import GraphCache, bucket, static_attention, static_plan, with_static_attention
from ..models.row_graphs import RowRunner, Rows
from ..models.spec_graphs import WIDTH, SpecFuture
from ..tree import TokenTree, TreeShape, search_candidates, tree_batch, unpack_trees
from .base import DraftInput
from .moa_core import (
    MoAParts,
    PassSlots,
    catch_up,
    commit_ca,
    commit_sa,
    draft_logits,
    draft_pass,
    lsa_memory,
    plan_fields,
)
from .search import Finite, top_k_search


class MoAGraphs:
    """MoADrafter's static paths (it holds the pools, parts and request states these read and write)."""

    chains = True  # a greedy static search's step chains in the overlapped loop (propose_chained)

    def _static_pass(self, tokens: torch.Tensor, at: PassSlots) -> torch.Tensor:
        """A draft pass (draft-vocab logits [n, Vd]) from the step runner; the eager pass over planned
        attention when no bucket fits."""
        if self._steps is None:
            static = self._static_parts()

            def step(ids, feat, rows, plans):
                slots = PassSlots(rows["positions"], rows["sa_slots"], rows["tli_slots"], **plan_fields(plans))
                return (draft_logits(static, draft_pass(static, self.kv, ids, slots)),)

            self._steps = self._on_stream(FrontierRunner(step, self.target.device, self.target.cfg.max_position))
        rows = {"positions": at.positions, "sa_slots": at.sa_slots, "tli_slots": at.tli_slots}
        pools = (self.sa, self.mem, self.tli_kv)
        out = self._steps.run(tokens, None, rows, at.specs, pools)
        if out is not None:
            return out[0]
        at = replace(at, **plan_fields({n: plan_frontier(*spec) for n, spec in at.specs.items()}))
        return self._to_logits(draft_pass(self.parts, self.kv, tokens, at), False)

    def _static_parts(self) -> MoAParts:
        """The draft's parts attending with static_attention (the target's TLI layers too)."""
        if self._static is None:
            self._static = replace(
                self.parts,
                attention=static_attention,
                tli_layers=[self._tli_layer(li, with_static_attention(self.target)) for li in self.tli_layers],
            )
        return self._static

    def _search_runner(self) -> SearchRunner:
        if self._search is None:
            self._search = self._on_stream(SearchRunner(self.target.device, self.target.cfg.max_position))
            self._held = HeldSlots(self.sa)  # its temporary SA slots, held for good
        return self._search

    def _bind_search(self, b: int, shape: TreeShape) -> None:
        """The search runner bound to the pools a search of b requests at `shape` reads (its held slots taken for the
        batch's bucket), before a commit appends to its tables: held slots that grow with the bucket start the
        tables over (SearchRunner.bind), and a commit must append to the tables the search reads."""
        bb = bucket(b, self._search_runner().batch_buckets)
        if bb is not None:
            held = self._held.take(bb, 1 + (shape.depth - 1) * shape.topk)
            self._search.bind((self.sa, self.mem, self.tli_kv, held))

    def _forget_static(self, rid: int) -> None:
        """The request ended: its rows of the search's slot tables are free."""
        if self._search is not None:
            self._search.forget(rid)

    def _static_commit(self, batch: list[DraftInput]) -> Rows | None:
        """_flush's work as one row function call (the row runner's: each queued token alone, its LSA memory, CA and
        SA K/V, their slots appended to the search's slot tables), prepared: the host's bookkeeping done (the
        requests' slot lists grown, their queues emptied, the tables' cells counted), the call to run next, alone
        (_run_commit) or first in the search's graph. None: nothing left to run, where nothing is queued or a static
        commit does not apply and _flush ran instead (memory from captured layers, an edge client's own pools, a
        catch-up's holes, more rows than the buckets)."""
        sts = [self.reqs[d.rid] for d in batch]
        commits = [[c.slots.numel() for c in st.pending] for st in sts]
        sizes = [sum(c) for c in commits]
        if self.capture_layers or self.remote or catch_up(commits)[1] is not None:
            return self._flush(batch)
        names = self._commit_tables()
        if self._commits is None:
            self._commits = self._on_stream(RowRunner(self._commit_rows, 5 + len(names), self.target.device))
        t = sum(sizes)
        if self._commits.bucket_of(t) is None:
            return self._flush(batch)  # (nothing queued: nothing to do)
        caps = [c for st in sts for c in st.pending]
        # token j of a request's queue is at position (its verified tokens so far) + j
        pos = [st.target_slots.numel() + j for st, n in zip(sts, sizes) for j in range(n)]
        ids = [x for c in caps for x in c.token_ids]
        held = {
            "sa": [st.sa_slots for st in sts],
            "ca": [st.mem_slots for st in sts],
            "tli": [st.target_slots for st in sts],
        }
        tables = [self._search_runner().table(n) for n in names]
        rids = [d.rid for d in batch]
        cells = [tb.appended(rids, [x.numel() for x in held[n]], sizes) for tb, n in zip(tables, names)]
        # (the step's commits: one gather's rows split per request, rejoined without a copy)
        target_slots, mem, sa = rejoin([c.slots for c in caps]), self.mem.alloc(t), self.sa.alloc(t)
        rows = self._commits.prepare([ids, pos, *(c for c, _ in cells)], [target_slots, mem, sa])
        for _, done in cells:  # (the call appends them before anything reads the tables)
            done()
        self.lsa_rows += t
        new = [x for add in zip(mem.split(sizes), sa.split(sizes), target_slots.split(sizes)) for x in add]
        parts = iter(grow([x for st in sts for x in (st.mem_slots, st.sa_slots, st.target_slots)], new))
        for st in sts:
            st.mem_slots, st.sa_slots, st.target_slots = next(parts), next(parts), next(parts)
            st.pending = []
        return rows

    def _commit_tables(self) -> tuple[str, ...]:
        """The search's slot tables a commit appends to."""
        return ("sa", "ca", "tli")[: 3 if self.tli_layers else 2]

    def _commit_pools(self) -> tuple:
        """What a commit writes and reads (graphs bake their addresses in)."""
        tables = (self._search_runner().table(n).table for n in self._commit_tables())
        return (self.sa, self.mem, self.tli_kv, *tables)

    def _run_commit(self, rows: Rows) -> None:
        """A prepared commit (_static_commit) alone."""
        self._commits.run_rows(rows, self._commit_pools())

    def _commit_rows(self, ids, positions, *cells_and_slots) -> None:
        """The row runner's function (each [R] int64 on the device; padding 0): the tokens' LSA memory over
        their K/V at every target layer, its CA K/V stored at `mem`, their SA K/V at `sa`; their SA, memory
        and target slots appended to the search's slot tables (at their cells)."""
        *cells, target_slots, mem, sa = cells_and_slots
        for name, slots, at in zip(("sa", "ca", "tli"), (sa, mem, target_slots), cells):
            self._search.tables[name].table.view(-1).index_put_((at,), slots)
        kv = self.tli_kv
        k, v = commit_ca(self.draft, lsa_memory(self.draft, kv.k, kv.v, target_slots), positions)
        self.mem.k[0][mem], self.mem.v[0][mem] = k, v
        k, v = commit_sa(self.draft, self.target.embed, ids, positions)
        self.sa.k[0][sa], self.sa.v[0][sa] = k, v

    def _static_search(
        self, batch: list[DraftInput], shape: TreeShape, commit: Rows | None = None, chained: tuple = ()
    ) -> list[TokenTree] | None:
        """The deterministic search's trees from the search runner (the roots' pass and every search
        step in one function; a prepared commit first, in the same graph), the same trees as the pass-by-pass
        search; None when no bucket fits (nothing run: the caller runs the commit).
        Every pass's temporary SA slots are the search's held slots (HeldSlots: request i's row, the root's,
        then step after step); its TLI slots (in the target's pool) are handed out at once ([b, 1 + (depth-1)*k],
        in the same order) and freed once the search is queued."""
        self._search_runner()
        b, sts = len(batch), [self.reqs[d.rid] for d in batch]
        prefixes = {"sa": [st.sa_slots for st in sts], "ca": [st.mem_slots for st in sts]}
        if self.tli_layers:
            prefixes["tli"] = [st.target_slots for st in sts]
        bk = self._search.bucket_of(b, {n: max(p.numel() for p in pre) for n, pre in prefixes.items()})
        if bk is None:
            return None
        width = 1 + (shape.depth - 1) * shape.topk
        held = self._held.take(bk[0], width)
        temps = [(self.tli_kv, self.tli_kv.alloc(b * width))] if self.tli_layers else []
        try:
            rows = {"root": [[d.token_ids[-1], d.seq_len] for d in batch]}  # [b, 2] (host ints)
            rows.update(("tli", s) for _, s in temps)  # ([b * width]: request after request)
            pools = (self.sa, self.mem, self.tli_kv, held)
            search = lambda bufs: self._search_fn(bufs, shape, held)  # noqa: E731
            # (the prefixes from the runner's slot tables on the device: only what their rows lack goes up)
            if commit is not None and not chained:  # (a chained commit counts on its own runner)
                self._commits.runs += 1  # (in the search's graph)
            keys = [d.rid for d in batch]
            if chained:  # (fut, prev): each request's root, length and prefixes from the previous step's path
                rows["prev"] = [[p] for p in chained[1]]
                patch = (id(chained[0]), lambda grids, lens, real: _chained_roots(chained[0], grids, lens, real))
                extra = shape.depth + 1
            else:
                patch, extra = None, 0
            out = self._search.run(
                shape, search, rows, prefixes, {}, pools, keys, first=commit, patch=patch, extra=extra
            )
        finally:
            for pool, s in temps:
                pool.free(s)
        longs, mask, scores, finite = out
        return unpack_trees(longs, mask, scores, finite, len(batch))

    def _search_fn(self, bufs: SearchBuffers, shape: TreeShape, held: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The captured search over a padded batch of B requests (held: the held SA slots' table): the roots'
        pass, depth - 1 search steps (each node's path mask grown on the device; SA, CA and TLI plans in static
        form), the trees packed (tree_batch) with target ids. Outputs as tree_batch's, then finite [] bool (every real
        request's draft logits finite)."""
        parts = self._static_parts()
        roots, seq_lens = bufs.rows["root"].unbind(1)
        bb, dev = roots.shape[0], roots.device
        sa_temp = held[:bb, : 1 + (shape.depth - 1) * shape.topk]  # [B, 1 + (depth-1)*k]
        tli_temp = bufs.rows.get("tli", torch.zeros_like(sa_temp))
        state = {"seen": torch.zeros(bb, 1, 0, dtype=torch.bool, device=dev), "passes": 0}
        # CA reads the verified memory only: one padding column (slot 0), read by a padded request alone
        ca_extra = torch.zeros(bb, 1, dtype=torch.long, device=dev)
        padded = ~bufs.real[:, None, None]

        def run(tokens: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
            """tokens [B, kk] target ids; parent [B, kk] index into the previous pass's nodes -> [B, kk, Vd]."""
            kk = tokens.shape[1]
            seen = advance_seen(state["seen"], parent, kk)  # [B, kk, E]: the pass's nodes are the last kk
            e = seen.shape[2]
            own = torch.cat(
                [seen.new_zeros(bb, kk, e - kk), torch.eye(kk, dtype=torch.bool, device=dev).expand(bb, kk, kk)], 2
            )
            sa_seen = seen if self.cfg.sa_tree_attention == "ancestors" else own
            plans = {
                "sa_plan": static_plan(*bufs.prefixes["sa"], sa_temp[:, :e], sa_seen),
                "ca_plan": static_plan(*bufs.prefixes["ca"], ca_extra, padded.expand(bb, kk, 1)),
                "tli_plan": static_plan(*bufs.prefixes["tli"], tli_temp[:, :e], seen) if self.tli_layers else None,
            }
            # every node of this pass is at depth `passes` (the roots' pass: 0)
            pos = (seq_lens + state["passes"])[:, None].expand(bb, kk).reshape(-1)
            slots = [t[:, e - kk : e].reshape(-1) for t in (sa_temp, tli_temp)]
            h = draft_pass(parts, self.kv, tokens.reshape(-1), PassSlots(pos, *slots, **plans))
            state["seen"], state["passes"] = seen, state["passes"] + 1
            return draft_logits(parts, h).view(bb, kk, -1)

        def step_fn(tokens: torch.Tensor, parent_beam: torch.Tensor | None) -> torch.Tensor:
            parent = torch.zeros_like(tokens) if parent_beam is None else parent_beam
            return run(self.hot_ids[tokens], parent)

        first = roots[:, None]
        finite = Finite(per_request=True)
        root_logits = run(first, torch.zeros_like(first))[:, 0]
        search = top_k_search(root_logits, step_fn, shape.topk, shape.depth, 0.0, finite)
        top, draft, scores, parent_flat = search_candidates(search, shape.num_draft_tokens)
        keep = scores >= shape.min_prob if shape.min_prob > 0 else None
        trees = tree_batch(roots, top, self.hot_ids[draft], scores, parent_flat, seq_lens, keep)
        return (*trees, (finite.flag | ~bufs.real).all())  # (padding requests aside)

    # --- chained steps: the overlapped loop's (serving/spec_step.py, models/spec_graphs.py) ----------------------
    def use_stream(self, stream) -> None:
        """The drafter's graphs go on `stream` (the target's: the overlapped loop orders them with its verify)."""
        self.stream = stream
        for runner in (self._steps, self._search, self._commits, getattr(self, "_chained_commits", None)):
            if runner is not None and runner.cache.stream is not stream:
                runner.cache = GraphCache(runner.cache.device, True, stream)

    def _on_stream(self, runner):
        if self.stream is not None:
            runner.cache = GraphCache(runner.cache.device, True, self.stream)
        return runner

    def chain_fits(self, rids: list[int], shape: TreeShape, chained: bool) -> bool:
        """Whether a chained step's commit and search replay from one graph (chained: W = depth + 1 rows a request
        from the futures; else the queued tokens' ordinary commit)."""
        cpu_min_prob = shape.min_prob and self.target.device.type == "cpu"  # (propose's eager search)
        if not self.step_graphs or cpu_min_prob or shape.depth + 1 > WIDTH or any(r not in self.reqs for r in rids):
            return False
        if self.capture_layers or self.remote or self.q8 is not None:
            return False
        sts, w = [self.reqs[r] for r in rids], shape.depth + 1
        adds = [w if chained else sum(c.slots.numel() for c in st.pending) for st in sts]
        if chained and (self._chained_runner().bucket_of(w * len(sts)) is None):
            return False
        lens = {"sa": max(st.sa_slots.numel() + k for st, k in zip(sts, adds))}
        lens["ca"] = max(st.mem_slots.numel() + k for st, k in zip(sts, adds))
        if self.tli_layers:
            lens["tli"] = max(st.target_slots.numel() + k for st, k in zip(sts, adds))
        return self._search_runner().bucket_of(len(sts), lens) is not None

    def _chained_runner(self) -> RowRunner:
        runner = getattr(self, "_chained_commits", None)
        if runner is None:
            fields = 7 + len(self._commit_tables())
            runner = self._chained_commits = self._on_stream(RowRunner(self._chained_rows, fields, self.target.device))
        return runner

    @torch.inference_mode()
    def propose_chained(self, batch: list[DraftInput], shape: TreeShape, fut: SpecFuture, prev: list[int]):
        """The trees of a chained step: each request's commit of the previous step's accepted path (read from `fut`
        at its row `prev`: W = depth + 1 rows, their memory and SA slots taken now and kept once the path is read:
        commit_chained), then the search, in one graph."""
        sts, w, b = [self.reqs[d.rid] for d in batch], shape.depth + 1, len(batch)
        self._bind_search(b, shape)  # (before the commit counts the cells it appends)
        self._fut = fut
        names = self._commit_tables()
        held = {"sa": [st.sa_slots for st in sts], "ca": [st.mem_slots for st in sts]}
        held["tli"] = [st.target_slots for st in sts]
        rids = [d.rid for d in batch]
        cells = [self._search.table(n).appended(rids, [x.numel() for x in held[n]], [w] * b)[0] for n in names]
        mem, sa = self.mem.alloc(b * w), self.sa.alloc(b * w)
        futures = self.__dict__.setdefault("_futures", {})
        for d, m, a in zip(batch, mem.split(w), sa.split(w)):
            futures[d.rid] = (m, a)
        try:
            pos = [st.target_slots.numel() + j for st in sts for j in range(w)]
            row_prev = [p + 1 for p in prev for _ in range(w)]  # (+1: a padding row's 0 is no request's)
            ints = [[0] * (b * w), pos, *cells, row_prev, list(range(w)) * b]
            rows = self._chained_runner().prepare(ints, [torch.zeros(b * w, dtype=torch.long), mem, sa])
            self._chained_commits.runs += 1  # (in the search's graph)
            trees = self._static_search(batch, shape, rows, (fut, prev))
            if trees is None:
                raise RuntimeError("a chained MoA step fits no search bucket")
        except BaseException:
            for d in batch:
                self.drop_chained(d.rid)
            raise
        return trees

    def _chained_rows(self, ids, positions, *rest) -> None:
        """The chained commit's row function (each [R] int64; padding 0): row r of request i is its path's node j
        (rest: the tables' cells, prev + 1, j, then target slots, memory and SA slots), real below the path's
        length; its token and target slot from the futures; the rest (padding) write the scratch slot and cell."""
        fut = self._fut
        *cells, prev1, j, target_slots, mem, sa = rest
        pr = (prev1 - 1).clamp(min=0)
        ok = (prev1 > 0) & (j < fut.lens[pr])
        keep = lambda x: torch.where(ok, x, 0)  # noqa: E731
        ids, slots = keep(fut.inputs[pr, j]), keep(fut.slots[pr, j])
        self._commit_rows(ids, keep(positions), *(keep(c) for c in cells), slots, keep(mem), keep(sa))

    def commit_chained(self, rid: int, n: int, slots: torch.Tensor | None = None) -> None:
        """The previous step's path is read: its first n rows were real (slots: their target slots): their memory
        and SA slots join the request's (the rest freed), the tables counted whole."""
        m, a = self.__dict__.get("_futures", {}).pop(rid, (None, None))
        st = self.reqs.get(rid)
        if m is None or st is None:
            return
        parts = iter(grow([st.mem_slots, st.sa_slots, st.target_slots], [m[:n], a[:n], slots]))
        st.mem_slots, st.sa_slots, st.target_slots = next(parts), next(parts), next(parts)
        self.mem.free(m[n:])
        self.sa.free(a[n:])
        self.lsa_rows += n
        for name, x in zip(("sa", "ca", "tli"), (st.sa_slots, st.mem_slots, st.target_slots)):
            if name in self._commit_tables():
                self._search.table(name).account(rid, x.numel())

    def drop_chained(self, rid: int, committed: int = 0) -> None:
        """The request ended before a chained step of its was read: that step's memory and SA slots go back, and the
        last `committed` of its tokens' too (that step's real rows, committed when the step before it was read)."""
        m, a = self.__dict__.get("_futures", {}).pop(rid, (None, None))
        if m is not None:
            self.mem.free(m)
            self.sa.free(a)
        st = self.reqs.get(rid)
        if committed and st is not None:
            self.mem.free(st.mem_slots[-committed:])
            self.sa.free(st.sa_slots[-committed:])
            st.mem_slots, st.sa_slots = st.mem_slots[:-committed], st.sa_slots[:-committed]
            st.target_slots = st.target_slots[:-committed]

    @torch.inference_mode()
    def settle(self, batch: list[DraftInput]) -> None:
        """The requests' queued tokens (their prompts) committed now, issued in order on the stream (the static commit
        alone, or _flush's eager work where it does not apply): a chained step's search reads them from the slot
        tables, an ordinary one's too."""
        if not self.step_graphs:
            return
        rows = self._static_commit(batch)
        if rows is not None:
            self._run_commit(rows)

    def joins(self, rid: int) -> bool:
        st = self.reqs.get(rid)
        return st is not None and not st.pending and rid not in self.__dict__.get("_futures", {})

    def join_chained(self, batch: list[DraftInput], fut: SpecFuture, rows: list[int]) -> int:
        """Each request, its tokens all committed (`joins`), at its row of the futures as a path of no node whose
        bonus token is its root: the chained commit commits nothing of it and the search starts at its root. -> 0."""
        at = torch.tensor(rows, dtype=torch.long)
        roots = torch.tensor([d.token_ids[-1] for d in batch], dtype=torch.long)

        def write(at, roots) -> None:
            at, roots = at.to(fut.lens.device), roots.to(fut.lens.device)
            fut.lens[at] = 0
            fut.tokens[at, 0] = roots

        self.stream.launch(write, at, roots)
        return 0


def _chained_roots(fut: SpecFuture, grids: dict, lens: dict, real: torch.Tensor) -> None:
    """A chained search's patch (SearchRunner.run's): each real request's root the previous path's bonus token, its
    length and its prefixes L longer (L: that path's length, from the futures at the request's row)."""
    pr = grids["prev"][:, 0].clamp(min=0)
    n = torch.where(real, fut.lens[pr], 0)
    root = grids["root"]
    root[:, 0].copy_(torch.where(real, fut.tokens[pr, (n - 1).clamp(min=0)], root[:, 0]))
    root[:, 1].add_(n)
    for x in lens.values():
        x.add_(n)
