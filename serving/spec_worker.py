"""The speculative worker: propose -> verify -> accept -> advance over the drafter contract (drafters/base.py),
as SGLang's eagle_worker and vLLM's spec_decode are, and the drafter's lifecycle around it.

    propose   the drafter's tree per drafting request (a predicted output's where it matches; root-only trees for
              the rest: a plain decode step), on the target's device
    verify    each request's accepted path on its rows of the step's logits (the sampler's rules), on the device
    accept    after the step's one device-to-host copy: the accepted nodes' KV slots join their requests, every
              other slot of the trees is freed (compaction by index, batch-wide)
    advance   the drafter's commit of the accepted nodes (their positions, slots and captured rows), then the
              accepted tokens appended (the sampler's stop rules)

With no drafter (vanilla decoding) every tree is root-only: the same loop, one token per step, so speed ratios
compare like with like. A drafter's fault sends the requests it drafted for back to vanilla decoding
(`fallback`), never fails them. The adaptive policy (serving/adaptive.py) picks each step's tree shape.
"""

from __future__ import annotations

import itertools
import logging

import torch

from sglang_ext.device import grow, to_device
from sglang_ext.drafters import Drafter, TargetCapture
from sglang_ext.drafters.prediction import PredictionLookup
from sglang_ext.sampling import greedy_tokens
from sglang_ext.tree import TokenTree, TreeShape, root_trees, trees_on
from sglang_ext.verify import AcceptedPath, VerifyResult, greedy_paths, greedy_results

from .adaptive import CONFIDENT_FROM_BATCH, AdaptiveSpeculation
from .kv_manager import KVManager
from .request import Request, RequestFault, StepEvent, fail, path_nodes, stage
from .sampler import Sampler

log = logging.getLogger(__name__)


class SpecWorker:
    """Speculation for the engine: `drafter` None is vanilla decoding; `tree` the configured shape; adaptive: the
    policy picks each step's shape (or none) from measured throughput; on_fallback(request, reason) hears of each
    request a drafter fault sends back to vanilla decoding (metrics)."""

    def __init__(
        self,
        drafter: Drafter | None,
        sampler: Sampler,
        kv: KVManager,
        model,
        tree: TreeShape,
        adaptive: bool = False,
        on_fallback=None,
    ):
        self.drafter, self.sampler, self.kv, self.model, self.tree = drafter, sampler, kv, model, tree
        self.on_fallback = on_fallback
        members = drafter.member_names if drafter is not None else ()
        self.policy = (
            AdaptiveSpeculation(tree, confident_from=CONFIDENT_FROM_BATCH, members=members, catch_up=True, defer=True)
            if adaptive and drafter is not None
            else None
        )
        self.last_shape: TreeShape | None = tree if drafter is not None else None
        self.chosen: tuple[int | None, TreeShape | None] | None = None  # the policy's choice made ahead (spec_step)
        self.commits = drafter is not None and drafter.needs_commit
        # predicted outputs for drafters that do not search them (model drafters)
        self.prediction = PredictionLookup() if drafter is not None and not drafter.reads_reference else None

    # --- the drafter's lifecycle ----------------------------------------------------------------
    def keep_prompt_capture(self, r: Request, captured: dict, start: int, n: int) -> None:
        """A prompt chunk's captured rows (start.. of the forward's), kept until the prompt is done."""
        if self.drafter is not None and captured:
            r.prompt_captured.append({l: h[start : start + n] for l, h in captured.items()})

    def start(self, r: Request, layers) -> None:
        """The prompt is prefilled: the drafter starts on the target's view of it (its captured `layers`)."""
        if self.drafter is None:
            return
        parts, r.prompt_captured = r.prompt_captured, []
        hidden = {l: torch.cat([p[l] for p in parts]) for l in layers} if parts else {}
        positions = to_device(torch.arange(len(r.prompt_ids)), self.model.device)
        cap = TargetCapture(r.prompt_ids, positions, r.slots, hidden, self.kv.pool, cached=r.cached_tokens)
        cap.cached_hidden = self.kv.cached_hidden(r)
        self.call(lambda: self.drafter.add_request(r.rid, cap), [r])

    def end(self, r: Request, taken: torch.Tensor | None) -> None:
        """The drafter forgets the request, keeping its state of the tokens the prefix cache holds (taken: per
        token, the target slot, or -1) when it keeps state beside the cache."""
        d = self.drafter
        if d.keeps_prefix_state and taken is not None and bool((taken >= 0).any()):
            self.call(lambda: d.release_request(r.rid, taken), [r])
        else:
            self.call(lambda: d.remove_request(r.rid), [r])

    def call(self, fn, reqs: list[Request]):
        """Run a drafter call; on failure, the affected requests fall back to vanilla decoding."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - any drafter fault must not break the request
            self.fallback(reqs, type(e).__name__)
            return None

    def fallback(self, reqs: list[Request], reason: str) -> None:
        for r in reqs:
            if not r.drafting:
                continue
            r.drafting = False
            try:
                self.drafter.remove_request(r.rid)
            except Exception:  # noqa: BLE001 - the drafter is already broken for this request
                pass
            if self.on_fallback:
                self.on_fallback(r, reason)

    # --- propose ----------------------------------------------------------------------------------
    def choose_shape(self, n: int) -> tuple[int | None, TreeShape]:
        """(the policy's option for a step of n decoding requests, or None; the shape to draft with). A choice the
        overlapped loop made ahead (`chosen`: spec_step.chain_next) is the next decoding step's."""
        if n and self.chosen is not None:
            (option, shape), self.chosen = self.chosen, None
            return option, shape
        option = self.policy.choose(n) if self.policy and n else None
        shape = self.policy.options[option] if option is not None else self.tree
        if n:
            self.last_shape = shape if self.drafter is not None else None
        return option, shape

    def observe(
        self, option: int | None, n: int, seconds: float, events: list[StepEvent], rows: int, draft_seconds: float
    ) -> None:
        """The policy learns what a step of n decoding requests under `option` gave (rows: its tree rows). A request's
        first drafted step also drafts over its prompt (EAGLE-3 caches its layer's K/V of every prompt pair), a cost of
        the request, not of a switch from off: the policy is told (`first`) where such requests are half the step's
        drafting ones or more (at bs 1 the step; with requests arriving at a large batch, a few in each step are its
        steady cost, and a policy that rated no such step would rate none)."""
        if option is None:
            return
        first = False
        if self.policy.options[option] is not None:  # (off drafts nothing: no request's first drafted step)
            drafting = [e.request for e in events if e.request.drafting]
            first = 2 * sum(not r.drafted for r in drafting) >= max(len(drafting), 1)
            for e in events:
                e.request.drafted = True
        self.policy.observe(
            option,
            n,
            seconds,
            sum(len(e.new_tokens) for e in events),
            rows,
            draft_seconds=draft_seconds,
            accepted=[e.accepted for e in events],
            drafted=[e.drafted for e in events],
            first=first,
        )

    def propose(self, reqs: list[Request], shape: TreeShape | None) -> list[TokenTree]:
        """One tree per request, on the target's device; root-only (a plain decode step) when not drafting. (A
        drafted token outside the vocabulary is caught on the device: verify.)"""
        if not reqs:
            return []
        trees: dict[int, TokenTree] = {}
        drafting = [r for r in reqs if r.drafting and self.drafter is not None and shape is not None]
        inputs = [r.draft_input() for r in drafting]
        if self.prediction is not None and any(r.reference for r in drafting):
            trees.update(self.prediction.trees(inputs, shape))
            # the model drafts the rest (and catches up later on the tokens it did not draft)
            drafting, inputs = [r for r in drafting if r.rid not in trees], [d for d in inputs if d.rid not in trees]
        if drafting:
            proposed = self.call(lambda: self.drafter.propose(inputs, shape), drafting)
            if proposed is not None:
                trees.update((r.rid, t) for r, t in zip(drafting, proposed) if t is not None)
        # the others' root-only trees all at once, on the target's device
        plain = [r for r in reqs if r.rid not in trees]
        roots = root_trees([r.output_ids[-1] for r in plain], [len(r.slots) for r in plain], self.model.device)
        trees.update((r.rid, t) for r, t in zip(plain, roots))
        return trees_on([trees[r.rid] for r in reqs], self.model.device)

    # --- verify -----------------------------------------------------------------------------------
    def verify(self, reqs: list[Request], trees: list[TokenTree], logits: torch.Tensor, greedy=None) -> list:
        """Each request's accepted path on its rows of the logits, on the device (or the RequestFault of
        its verification). A drafted tree's path carries whether the tree was a faulty drafter's (a token
        outside the vocabulary, never accepted; non-finite draft logits): the request falls back to
        vanilla decoding after the step's copy.
        Greedy requests whose rows are the raw logits (no penalties, min_tokens or grammar) are verified
        together (verify.greedy_paths: a fixed number of device ops for the step, not ~100 per request);
        the others one by one (Sampler.verify). A sampler subclass's own verify sees every request.
        greedy: the argmax and greedy paths a replayed verify took inside its graph (verify.GreedyRows), or None."""
        vocab = self.model.cfg.vocab_size
        starts = list(itertools.accumulate([t.num_nodes for t in trees], initial=0))
        wants_argmax = self.drafter is not None and self.drafter.wants_tree_argmax
        batches = type(self.sampler).verify is Sampler.verify
        together = [i for i, r in enumerate(reqs) if self.sampler.plain_greedy(r)] if batches else []
        argmax = None  # [R] the target's argmax at every tree row, when some request reads it
        if together or (wants_argmax and any(r.drafting for r in reqs)):
            argmax = greedy_tokens(logits[: starts[-1]]) if greedy is None else greedy.argmax
        # on the CPU the step's values are host values already: argmax read once, the walks on host lists
        on_host = greedy is None and logits.device.type == "cpu" and argmax is not None
        host = argmax.tolist() if on_host else None
        if on_host:  # (the requests that ask for logprobs take their rows on the tensor path)
            together = [i for i in together if reqs[i].params.logprobs is None]
        paths: dict[int, AcceptedPath | VerifyResult] = {}
        if together:
            try:
                picked, at = [trees[i] for i in together], [starts[i] for i in together]
                if greedy is not None:  # (computed inside the verify graph)
                    found = greedy.paths(picked, together)
                elif on_host:
                    found = greedy_results(picked, host, at, vocab)
                else:
                    found = greedy_paths(picked, argmax, vocab, at)
                paths = dict(zip(together, found))
            except Exception:  # noqa: BLE001 - then each request alone, in its own stage: a fault fails its request only
                log.warning("batched greedy verification failed; verifying request by request", exc_info=True)
        out = []
        for i, (r, t) in enumerate(zip(reqs, trees)):
            start, n = starts[i], t.num_nodes
            path = paths.get(i)
            if path is None:
                try:
                    path = self.sampler.verify(r, t, logits[start : start + n], self.last_shape)
                except RequestFault as f:
                    path = f
                if n > 1 and isinstance(path, AcceptedPath):
                    invalid = ((t.draft_tokens < 0) | (t.draft_tokens >= vocab)).any()
                    path.draft_invalid = invalid if t.finite is None else invalid | ~t.finite
            if wants_argmax and r.drafting and isinstance(path, AcceptedPath):  # (its commit reads it: same copy)
                path.tree_argmax = argmax[start : start + n]
            elif wants_argmax and r.drafting and isinstance(path, VerifyResult) and host is not None:
                path.tree_argmax = host[start : start + n]
            if r.params.logprobs is not None:
                path = self.sampler.with_logprobs(r, path, logits[start : start + n])
            out.append(path)
        return out

    # --- accept and advance -----------------------------------------------------------------------
    def accept(
        self,
        reqs: list[Request],
        trees: list[TokenTree],
        tree_slots: torch.Tensor,  # [T] int64 host ids: every tree's slots, tree after tree
        captured: dict,  # layer -> [R, H] the forward's captured rows (the trees' first, in the same order)
        logits: torch.Tensor,  # [R', V] the trees' rows first
        results: list,
    ) -> list[StepEvent]:
        """After the step's copy (results: per request, a VerifyResult or the RequestFault of its
        verification): keep the accepted nodes' KV, free the rest. A fault fails that request alone
        (its tree's slots freed with it).
        Batch-wide, in a fixed number of ops for the step: the accepted nodes' slots come out of
        tree_slots in one index op (compaction by index: each path's slots join its request in path
        order; host slot ids, no copy on the device), every other slot goes back in one free, and the
        requests' grown slot lists are one cat, each request's a view of it (never written in place)."""
        sizes = [t.num_nodes for t in trees]
        starts = list(itertools.accumulate(sizes, initial=0))
        paths: list[list[int] | RequestFault] = []  # per request: its accepted nodes, or its fault
        keep_at, drop_at = [], []  # flat indices into tree_slots
        for start, n, res in zip(starts, sizes, results):
            try:
                if isinstance(res, RequestFault):
                    raise res
                with stage("verify"):
                    nodes = path_nodes(res.accepted_nodes, n)
            except RequestFault as f:
                paths.append(f)
                drop_at += range(start, start + n)
                continue
            paths.append(nodes)
            keep_at += [start + x for x in nodes]
            if len(nodes) < n:
                on = set(nodes)
                drop_at += [start + x for x in range(n) if x not in on]
        # [K] the paths' slots, request after request (every slot in order, as plain decode keeps: no op)
        every = len(keep_at) == len(tree_slots) and keep_at == list(range(len(keep_at)))
        kept = tree_slots if every else tree_slots[torch.tensor(keep_at, dtype=torch.long)]
        if drop_at:
            self.kv.free(tree_slots[torch.tensor(drop_at, dtype=torch.long)])
        ok = [i for i, p in enumerate(paths) if not isinstance(p, RequestFault)]
        keeps = dict(zip(ok, kept.split([len(paths[i]) for i in ok]))) if ok else {}
        for i, s in zip(ok, grow([reqs[i].slots for i in ok], [keeps[i] for i in ok])):
            reqs[i].slots = s
        commits = self.commit_inputs(reqs, trees, results, paths, starts, captured)
        events = []
        for i, (r, t, res, path) in enumerate(zip(reqs, trees, results, paths)):
            if isinstance(path, RequestFault):
                events.append(fail(r, path))
                continue
            if res.draft_invalid:
                self.fallback([r], "invalid_draft")
            rows = [starts[i] + x for x in path]  # the path's rows of the step's logits
            events.append(self._advance(r, t, res, keeps[i], logits, rows, commits.get(i)))
        return events

    def commit_inputs(
        self, reqs: list[Request], trees: list[TokenTree], results: list, paths: list, starts: list[int], captured: dict
    ) -> dict[int, tuple[torch.Tensor, dict]]:
        """For each request (by index) whose drafter commits this step: its accepted nodes' positions [k] and
        captured rows {layer: [k, H]} on the device, gathered for all of them at once (the rows' indices and the
        positions in one copy up, one index op per layer, then views per request; the requests' slot lists hold
        their accepted nodes already). A drafter commits for a request that drafts and whose tree was valid (an
        invalid one's request falls back to vanilla decoding first)."""
        if not self.commits:
            return {}
        who = [
            i
            for i, (r, res, p) in enumerate(zip(reqs, results, paths))
            if r.drafting and not isinstance(p, RequestFault) and not res.draft_invalid
        ]
        if not who:
            return {}
        roots = all(trees[i].num_nodes == 1 for i in who)
        if roots and self.drafter.catches_up:
            return {}  # (speculation off: the drafter takes these tokens at its next propose; off costs it nothing)
        if roots and [starts[i] for i in who] == list(range(len(who))):
            # every tree root-only (the policy kept drafting off), every request committing: each commit is its
            # tree's root, at the tree's position, and its captured rows are the forward's first rows in order
            if self.drafter.commits_roots:  # (one call for all: no capture built per request)
                rids = [reqs[i].rid for i in who]
                self.call(lambda: self.drafter.commit_roots(rids, captured), [reqs[i] for i in who])
                return {}
            hidden = {l: h[: len(who)].split(1) for l, h in captured.items()}
            return {i: (trees[i].positions, {l: rows[j] for l, rows in hidden.items()}) for j, i in enumerate(who)}
        dev = self.model.device
        sizes = [len(paths[i]) for i in who]
        # a path's node j is at depth j: at position root + j (a tree's positions are its root's + depth; the root's
        # is the request's committed tokens before the step, its slots less the path's)
        pos = [p for i in who for p in range(len(reqs[i].slots) - len(paths[i]), len(reqs[i].slots))]
        at = [starts[i] + x for i in who for x in paths[i]] if captured else []
        up = to_device(torch.tensor(at + pos, dtype=torch.long), dev).split([len(at), *sizes])  # (one copy up)
        # consecutive rows (a chain's accepted prefix; one request's root and first child) are a view, not a gather
        run = bool(at) and at == list(range(at[0], at[0] + len(at)))
        rows_of = (lambda h: h[at[0] : at[-1] + 1]) if run else (lambda h: h[up[0]])
        hidden = {l: rows_of(h).split(sizes) if len(sizes) > 1 else (rows_of(h),) for l, h in captured.items()}
        return {i: (up[1 + j], {l: rows[j] for l, rows in hidden.items()}) for j, i in enumerate(who)}

    def _advance(
        self,
        r: Request,
        t: TokenTree,
        res: VerifyResult,
        keep: torch.Tensor,
        logits: torch.Tensor,
        rows: list[int],
        commit: tuple[torch.Tensor, dict] | None,
    ) -> StepEvent:
        """After a verify: stats, the drafter's commit, then the accepted tokens (keep: the accepted
        nodes' slots; rows: their rows of the step's logits, in path order; commit: their positions and
        captured rows when the drafter commits, from commit_inputs)."""
        n = t.num_nodes
        self._record(r, res, n - 1)
        if commit is not None:
            positions, hidden = commit
            argmax = None if res.tree_argmax is None else torch.tensor(res.tree_argmax)  # (host values)
            tokens = [r.token_ids[-1]] + res.tokens[:-1]  # the root, then the accepted drafts: host values
            cap = TargetCapture(tokens, positions, keep, hidden, self.kv.pool, argmax)
            self.call(lambda: self.drafter.commit(r.rid, cap), [r])
        try:
            new = self.sampler.append(r, res.tokens)
            # token i of the accepted path came from the target's logits at accepted node i
            lps = self.sampler.logprobs(r, logits, rows, new, res.logprobs)
            return StepEvent(r, new, res.num_accepted, n - 1, lps)
        except RequestFault as f:
            return fail(r, f)

    @staticmethod
    def _record(r: Request, res: VerifyResult, drafted: int) -> None:
        st = r.stats
        st.verify_steps += 1
        st.draft_tokens += drafted
        st.accepted_tokens += res.num_accepted
        while len(st.accepted_by_depth) < res.num_accepted:
            st.accepted_by_depth.append(0)
        for i in range(res.num_accepted):
            st.accepted_by_depth[i] += 1
