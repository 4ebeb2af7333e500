"""The embedded speculative engine: request -> prefill -> (draft -> tree -> verify -> accept)* -> done.

One step() advances every running request by one draft/verify cycle in a single batched target
forward; new requests are prefilled in that same forward. The vanilla path is the
same loop with root-only trees (one token per step), so speed ratios compare like with like.

Ownership: the engine owns requests and the target KV pool; a drafter owns its own state.

Per request, the target KV holds every token except the last one (the root of the next tree):

    tokens:  p0 p1 p2 p3 | g0 g1 g2       (prompt | generated)
    slots:   s  s  s  s  | s  s  -        g2 is the root: the next verify forward computes its K/V

Prefix cache (serving/prefix_cache.py): a request's prompt is matched against the tokens earlier requests of its
tenant left in the cache; a hit of m tokens starts the request with the cache's slots for them (locked while it
runs) and prefills only prompt[m:]. When a request ends, its tokens whose K/V was computed (the prompt and the
accepted outputs: never a rejected draft's slots, which were freed at their verify) go into the cache, and the
drafter keeps or drops its own state of them (drafters/base.py). The pool's free slots run out only after the
cache's unlocked tokens are evicted, least recently used first. Slot accounts: free + cached + the requests' own
== the pool (`slot_accounts`).

Faults: what is computed for one request alone (its penalties, masks, verification, sampling, logprobs,
grammar state) runs inside a `stage`; a fault there fails that request alone (finish_reason "error",
`Request.error` = the stage) and frees its KV, while the step's other requests carry on unchanged. A
fault outside every stage (the batched forward, the step's bookkeeping) fails the step; the caller
(the scheduler) then fails every request and calls `reset()`.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace

import torch

from sglang_ext.attention import causal_mask, plan_attention, prefix_and_tree_mask
from sglang_ext.device import to_device, upload
from sglang_ext.drafters import Drafter, DraftInput, TargetCapture, default_tree, make_drafter, resolve_drafter
from sglang_ext.drafters.prediction import PredictionLookup
from sglang_ext.grammar import Grammars, apply_bitmask, tree_bitmask
from sglang_ext.models import Target, load_target, resolve_device
from sglang_ext.models.graph_runner import GraphRunner
from sglang_ext.models.kv_pool import zeroed_buffers
from sglang_ext.penalties import ban_early_stops, penalize_tree
from sglang_ext.sampling import (
    InvalidRequest,
    SamplingParams,
    TokenLogprob,
    draw,
    greedy_tokens,
    logits_to_probs,
    seeded_token,
    token_logprobs,
)
from sglang_ext.tree import TokenTree, TreeShape, root_tree, root_trees, trees_on
from sglang_ext.verify import (
    AcceptedPath,
    VerifyResult,
    coupled_path,
    greedy_path,
    greedy_paths,
    path_logprobs,
    sampling_path,
    to_host,
)

from .adaptive import CONFIDENT_FROM_BATCH, AdaptiveSpeculation
from .config import EngineConfig
from .prefix_cache import PrefixCache
from .request import (  # (the request's data: callers import them from the engine too)
    CacheFlush,
    Request,
    RequestFault,
    RequestStats,
    SlotAccounts,
    StepEvent,
    path_nodes,
    stage,
)

__all__ = [
    "CacheFlush",
    "Engine",
    "Request",
    "RequestFault",
    "RequestStats",
    "SlotAccounts",
    "StepEvent",
    "build_engine",
]

PREDICTION_HEAD = 4  # prompt tokens before a predicted output in the drafter's reference (the assistant turn header)

log = logging.getLogger(__name__)


class Engine:
    """The engine around a target and a drafter (None: vanilla decoding), with the settings of an
    EngineConfig (its model / dtype / device / drafter names are for build_engine, which loads them).

    The config is the only place settings come from, so a setting added to the engine is one field
    in one dataclass, and every caller (CLI, server, benchmarks, tests) sets it the same way. The
    tree stays in the config too: `Engine(t, d, EngineConfig(tree=TreeShape(3, 1, 4)))` is a little
    longer than a tree argument, but a tree argument beside the config would be a second source for
    the same setting. `config.tree` None: the drafter's default tree (its registry entry, by
    `drafter.name`); `self.config` is the config with that tree filled in.
    """

    def __init__(
        self, target: Target, drafter: Drafter | None = None, config: EngineConfig | None = None, on_fallback=None
    ):
        config = config or EngineConfig()
        if config.tree is None:
            config = replace(config, tree=default_tree(getattr(drafter, "name", None)))
        self.config = config
        self.target, self.model = target, target.model
        self.drafter = drafter
        self.tree = config.tree
        self.kv = self.model.new_kv_pool(config.kv_slots)
        cap = self.model.cfg.max_position
        self.max_context = min(config.max_context or cap, cap)
        self.eos_ids = set(self.model.cfg.eos_token_ids)
        eos = getattr(target.tokenizer, "eos_token_id", None)
        if eos is not None:
            self.eos_ids.add(eos)
        self.grammars = Grammars(target.tokenizer, self.model.cfg.vocab_size, sorted(self.eos_ids))
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._in_step: list[Request] = []  # taken from `waiting` by this step: a failed step's reset releases them
        self._ids = itertools.count()
        self.on_fallback = on_fallback  # callback(request, reason) for metrics
        # per-step choice of tree shape / no speculation from measured throughput (serving default)
        self.policy = (
            AdaptiveSpeculation(
                self.tree, confident_from=CONFIDENT_FROM_BATCH, members=getattr(drafter, "member_names", ())
            )
            if config.adaptive and drafter is not None
            else None
        )
        self.last_shape: TreeShape | None = self.tree if drafter is not None else None
        self.capture_layers = tuple(drafter.capture_layers) if drafter else ()
        self.prefix_cache = PrefixCache(config.prefix_cache_tokens) if config.prefix_cache else None
        self._prefix_hidden = self._hidden_store()
        self._drafter_commits = getattr(drafter, "needs_commit", True)
        # predicted outputs for drafters that do not search them (model drafters)
        self._prediction = (
            PredictionLookup() if drafter is not None and not getattr(drafter, "reads_reference", False) else None
        )
        self.prefill_tokens = config.prefill_tokens  # prompt tokens prefilled per step at most (longer in chunks)
        self.mixed_prefill = config.mixed_prefill  # False: arrivals get a forward of their own before the decode one
        # steps without prompt rows replay CUDA graphs when their shape fits a bucket (None: always eager)
        self.graph_runner = (
            GraphRunner(self.model, self.capture_layers)
            if config.cuda_graphs and self.model.device.type == "cuda"
            else None
        )
        if self.graph_runner is not None and hasattr(drafter, "step_graphs"):
            drafter.step_graphs = True  # a drafter with a captured step replays it too

    def _hidden_store(self) -> dict[int, torch.Tensor] | None:
        """Per captured layer, a row for every slot of the pool, written with the slot's K/V at every forward: what a
        drafter reading the captured layers gets for a hit's cached tokens (drafters/base.py). None without a prefix
        cache, or for drafters that read only a request's last token (reads_prefix_hidden = False)."""
        reads = getattr(self.drafter, "reads_prefix_hidden", True)
        if self.prefix_cache is None or not self.capture_layers or not reads:
            return None
        m = self.model
        shape = (self.kv.num_slots, m.cfg.hidden_size)
        return dict(zip(self.capture_layers, zeroed_buffers(len(self.capture_layers), shape, m.dtype, m.device)))

    # --- admission ----------------------------------------------------------------------------
    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, grammar: object | None = None, tenant: str = ""
    ) -> Request:
        """grammar: params.grammar compiled elsewhere (the server's compile workers); None: compiled here.
        tenant: the prefix cache's namespace (requests hit only their own tenant's prefixes)."""
        if not prompt_ids:
            raise InvalidRequest("prompt is empty", "messages")
        vocab = self.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise InvalidRequest(f"prompt has token ids outside the vocabulary [0, {vocab})", "prompt")
        params.check_vocab(vocab)
        if len(prompt_ids) + 1 > self.max_context:
            raise InvalidRequest(
                f"prompt has {len(prompt_ids)} tokens; the context limit is {self.max_context}", "messages"
            )
        gen = None if params.greedy else params.generator(self.model.device)  # draws on the target's device
        req = Request(next(self._ids), list(prompt_ids), params, gen, tenant=tenant)
        self._use_cached_prefix(req)
        if params.grammar is not None:
            req.matcher = self.grammars.matcher(params.grammar if grammar is None else grammar)
        if params.prediction:  # NOTE: behind the prompt's tail, so the prediction's first tokens can be drafted
            req.reference = req.prompt_ids[-PREDICTION_HEAD:] + list(params.prediction)
        self.waiting.append(req)
        return req

    def _cacheable(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """How much of a prompt may come from the prefix cache: all but its last token (whose logits give the first
        output token), none when the request asks for prompt logprobs (the cached tokens' logits are not kept)."""
        if self.prefix_cache is None or params.prompt_logprobs is not None:
            return 0
        return len(prompt_ids) - 1

    def cached_prefix(self, prompt_ids: list[int], params: SamplingParams, tenant: str = "") -> tuple[int, int]:
        """(prompt tokens a request would take from the prefix cache now, how many of those no running request
        uses): the KV room admitting it takes is its prompt + outputs less the first, plus the second."""
        n = self._cacheable(prompt_ids, params)
        return self.prefix_cache.peek(tenant, prompt_ids[:n]) if n else (0, 0)

    def _use_cached_prefix(self, r: Request) -> None:
        """Start the request on the longest cached prefix of its prompt (locked until it ends); again when its
        prefill starts (a request queued behind another with the same prompt then finds it cached)."""
        n = self._cacheable(r.prompt_ids, r.params)
        hit = self.prefix_cache.match(r.tenant, r.prompt_ids[:n]) if n else None
        if hit is None or hit.length <= r.shared:
            return
        self.prefix_cache.lock(hit.node)
        if r.cache_node is not None:
            self._let_go(self.prefix_cache.unlock(r.cache_node))  # (a shorter hit: its slots are the cache's)
        r.slots, r.prefilled, r.cache_node = hit.slots.clone(), hit.length, hit.node
        r.cached_tokens = r.shared = hit.length

    def _share(self, r: Request, end: int) -> None:
        """Put the request's tokens [0, end) (their K/V in its slots) into the prefix cache while it runs, so that
        requests arriving meanwhile hit them (after each prefilled chunk, and at its end): the cache takes the
        tokens it did not hold; tokens another request cached meanwhile switch to the cache's slots (the request's
        own copies freed: same tokens, same K/V). Its lock moves to the end of the path. A request whose path was
        flushed keeps its slots to itself."""
        cache = self.prefix_cache
        if cache is None or end <= r.shared or (r.cache_node is not None and r.cache_node.detached):
            return
        key = r.token_ids[:end]
        first = cache.insert(r.tenant, key, r.slots[:end])  # (>= shared: the path so far is the cache's, locked)
        path = cache.match(r.tenant, key)
        cache.lock(path.node)
        if r.cache_node is not None:
            cache.unlock(r.cache_node)  # (not detached: nothing freed)
        self.kv.free(r.slots[r.shared : first])
        r.slots = torch.cat([path.slots, r.slots[end:]])
        r.shared, r.cache_node = end, path.node

    def abort(self, req: Request) -> None:
        """Stop a request now and free its KV (e.g. the client went away)."""
        if req in self.waiting:
            self.waiting.remove(req)
        if not req.finished:
            req.finish_reason = "abort"
        self._release(req)

    def _release(self, req: Request) -> None:
        """The request's hold on the pool ends: its computed tokens go into the prefix cache (the drafter keeping
        its state of those the cache took, if it keeps any), the rest of its slots are freed."""
        if req in self.waiting:  # (a request that failed part-way through a chunked prefill)
            self.waiting.remove(req)
        drafted = req in self.running and self.drafter is not None and req.drafting
        if req in self.running:
            self.running.remove(req)
        taken = self._settle(req)
        if drafted:
            self._end_drafting(req, taken)
        self.kv.free(req.slots[req.shared :])
        req.slots = torch.empty(0, dtype=torch.long)
        if self.prefix_cache is not None:
            self._let_go(self.prefix_cache.trim())

    def _settle(self, r: Request) -> torch.Tensor | None:
        """At the request's end, its computed tokens go into the prefix cache (slot i holds the K/V of
        token_ids[i]; slots past the tokens, drafts accepted after a stop, are not cached), unless it failed, and
        its lock goes. Returns, per token, its slot when the cache holds it, else -1: the drafter keeps its state
        of those under them (also where the cache took them from another request: that fills the state a request
        without any left, e.g. one drafted from its predicted output); None when its path was flushed (the cache
        holds none of them for good). What it still owns: slots[shared:]."""
        cache = self.prefix_cache
        if cache is None:
            return None
        n = min(len(r.slots), len(r.token_ids))
        flushed = r.cache_node is not None and r.cache_node.detached
        if r.finish_reason != "error":
            self._share(r, n)
        taken = torch.full((n,), -1, dtype=torch.long)
        taken[: r.shared] = r.slots[: r.shared]
        node, r.cache_node = r.cache_node, None
        if node is not None:
            self._let_go(cache.unlock(node))  # (a flushed path's slots, once its last user ends)
        return None if flushed else taken

    def _end_drafting(self, r: Request, taken: torch.Tensor | None) -> None:
        """The drafter forgets the request, keeping its state of the tokens the prefix cache holds (taken: per
        token, the target slot, or -1) when it keeps state beside the cache."""
        release = getattr(self.drafter, "release_request", None)
        if release is not None and taken is not None and bool((taken >= 0).any()):
            self._drafter_call(lambda: release(r.rid, taken), [r])
        else:
            self._drafter_call(lambda: self.drafter.remove_request(r.rid), [r])

    def _let_go(self, slots: torch.Tensor) -> None:
        """Slots the prefix cache let go (evicted, trimmed, flushed): the drafter drops what it kept under them, and
        they are free."""
        if not slots.numel():
            return
        drop = getattr(self.drafter, "drop_prefix", None)
        if drop is not None:
            try:
                drop(slots)
            except Exception:  # noqa: BLE001 - kept drafter state only drafts: never worth failing a step
                log.exception("the drafter failed to drop its state of %d evicted prefix tokens", slots.numel())
        self.kv.free(slots)

    def _alloc(self, n: int) -> torch.Tensor:
        """n slots of the pool, the prefix cache's least recently used unlocked tokens evicted when too few are free."""
        self._room(n)
        return self.kv.alloc(n)

    def _alloc_split(self, sizes: list[int]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Slots for every tree of a step in one alloc (as _alloc): (all [sum(sizes)] int64, one view per tree)."""
        self._room(sum(sizes))
        return self.kv.alloc_split(sizes)

    def _room(self, n: int) -> None:
        """Evict the prefix cache's least recently used unlocked tokens until n slots are free (or none is left)."""
        short = n - self.kv.num_free
        if short > 0 and self.prefix_cache is not None:
            self._let_go(self.prefix_cache.evict(short))

    def flush_cache(self) -> CacheFlush:
        """Empty the prefix cache: tokens no request uses are freed now; those in use leave the cache (no request
        hits them again) and are freed when their last request ends."""
        if self.prefix_cache is None:
            return CacheFlush(0, 0, 0)
        flushed = self.prefix_cache.flush()
        self._let_go(flushed.slots)
        users = sum(r.cache_node is not None for r in self.waiting + self.running)
        return CacheFlush(flushed.slots.numel(), flushed.kept, users)

    def slot_accounts(self) -> SlotAccounts:
        """Where every slot of the pool is (between steps)."""
        c = self.prefix_cache
        held = sum(len(r.slots) - r.shared for r in self.waiting + self.running)
        cached, detached = (c.tokens, c.detached) if c is not None else (0, 0)
        return SlotAccounts(self.kv.num_slots - 1, self.kv.num_free, cached, detached, held)

    def reset(self) -> None:
        """Drop every request and leave the KV pool whole: after a fault no single request can be
        blamed for, the engine starts again from a clean state (the caller fails the requests; the
        prefix cache starts empty too)."""
        left = self.waiting + self.running
        for r in left + [r for r in self._in_step if not any(r is x for x in left)]:
            if not r.finished:
                r.finish_reason, r.error = "error", "step"
            self._release(r)
        self.waiting, self.running, self._in_step = [], [], []
        self.flush_cache()
        leaked = self.kv.num_slots - 1 - self.kv.num_free
        if leaked:  # slots no request or cache entry accounts for: a bug
            log.error("%d KV slots still held with no request left; the KV pool is rebuilt", leaked)
            self.kv = self.model.new_kv_pool(self.kv.num_slots)
            if self.prefix_cache is not None:  # the cache's entries (detached ones too) were the old pool's
                self.prefix_cache = PrefixCache(self.config.prefix_cache_tokens)
                drop = getattr(self.drafter, "drop_prefix", None)
                if drop is not None:  # and so was the drafter's state kept beside them
                    drop(torch.arange(1, self.kv.num_slots))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step -----------------------------------------------------------------------------
    def step(self) -> list[StepEvent]:
        chunks = self._admit()
        self._in_step = [r for r, _ in chunks]
        decoding = list(self.running)
        if self.mixed_prefill:
            events = self._forward_step(decoding, chunks) if decoding or chunks else []
        else:
            events = (self._forward_step([], chunks) if chunks else []) + (
                self._forward_step(decoding, []) if decoding else []
            )
        for e in events:
            if e.request.finished:
                self._release(e.request)
        self._in_step = []
        return events

    def _admit(self) -> list[tuple[Request, int]]:
        """The prompt chunks this step prefills: (request, end) for prompt tokens [r.prefilled, end).
        NOTE: at most prefill_tokens prompt tokens per step; a prompt that does not fit is split
        (chunked prefill), so one long prompt holds the running requests' next tokens up for one
        chunk's time, not its whole prefill. A request whose prompt is done leaves the queue; the one
        split stays at its head."""
        chunks, budget = [], self.prefill_tokens
        for r in self.waiting:
            if budget <= 0:
                break
            if r.prefilled == r.shared:  # nothing prefilled yet: the cache may hold more of its prompt by now
                self._use_cached_prefix(r)
            end = min(len(r.prompt_ids), r.prefilled + budget)
            chunks.append((r, end))
            budget -= end - r.prefilled
        whole = sum(end == len(r.prompt_ids) for r, end in chunks)
        self.waiting = self.waiting[whole:]
        return chunks

    def _forward_step(self, reqs: list[Request], chunks: list[tuple[Request, int]]) -> list[StepEvent]:
        """One target forward for the whole step: the running requests' trees (draft -> tree ->
        verify -> accept) and the arrivals' prompt chunks (prefill -> first token once a prompt is
        done) side by side.
        NOTE: one forward, not a prefill forward and a decode forward: the prompt rows share the pass
        over the weights with the decode rows (a step's fixed cost), and arrivals one or two at a time
        (what speculation's uneven finishing gives) cost no more than arrivals in a group.
        Device rule: everything up to the verified paths and first tokens runs on the target's device
        and reads nothing back; `_to_host` then copies every request's result at once (the step's one
        device-to-host copy, output logprobs included when asked) and the bookkeeping after it is host
        work. Prompt logprobs and grammar masks (built by xgrammar on the host) add reads of their own."""
        t0 = time.perf_counter()
        option = self.policy.choose(len(reqs)) if self.policy and reqs else None
        shape = self.policy.options[option] if option is not None else self.tree
        if reqs:
            self.last_shape = shape if self.drafter is not None else None
        t_propose = time.perf_counter()
        dev = self.model.device
        trees = trees_on(self._propose(reqs, shape), dev) if reqs else []
        t_drafted = time.perf_counter()
        sizes = [t.num_nodes for t in trees]
        # every tree's slots in one alloc, tree after tree (tree_slots [T] int64 host ids; new_slots: views)
        tree_slots, new_slots = self._alloc_split(sizes) if trees else (torch.empty(0, dtype=torch.long), ())
        ids = [t.draft_tokens for t in trees]
        pos = [t.positions for t in trees]
        slots = list(new_slots)
        tree_rows = sum(sizes)
        chunk_slots, chunk_masks = [], []
        try:
            for r, end in chunks:
                s = self._alloc(end - r.prefilled)
                chunk_slots.append(s)
                ids.append(torch.tensor(r.prompt_ids[r.prefilled : end]))
                pos.append(torch.arange(r.prefilled, end))
                slots.append(s)
                chunk_masks.append(causal_mask(end - r.prefilled, r.prefilled))
            # NOTE: a faulty drafter's token outside the vocabulary must not index past the embedding (on
            # a GPU, a device-side assert); verification never accepts it (_verify_trees flags it). The
            # graph runner clamps inside its replay.
            top = self.model.cfg.vocab_size - 1
            g = self.graph_runner
            if g is not None and not chunks and g.can_run(sizes, [len(r.slots) for r in reqs]):
                out = g.run(ids, pos, slots, [r.slots for r in reqs], [t.tree_mask for t in trees], self.kv)
            else:
                masks = [prefix_and_tree_mask(t.tree_mask, len(r.slots)) for r, t in zip(reqs, trees)] + chunk_masks
                # each request's [committed | new] slots: one cat for the batch, a view per request
                owners = reqs + [r for r, _ in chunks]
                kv_all = torch.cat([x for r, s in zip(owners, slots) for x in (r.slots, s)])
                kv_lists = kv_all.split([len(r.slots) + len(s) for r, s in zip(owners, slots)])
                k = len(ids)
                placed = upload(ids + pos + masks, dev)  # the prompts' ids and masks: one copy per dtype
                ids, pos, masks = placed[:k], placed[k : 2 * k], placed[2 * k :]
                out = self.model.forward(
                    torch.cat(ids).clamp_(0, top),
                    torch.cat(pos),
                    to_device(torch.cat(slots), dev),
                    plan_attention(kv_lists, masks, device=dev),
                    self.kv,
                    self.capture_layers,
                )
            self._keep_hidden(slots, out.captured)
        except BaseException:
            for s in [tree_slots, *chunk_slots]:  # a failed forward must not leak the trees' slots or the chunks'
                self.kv.free(s)
            raise
        # one lm_head matmul for the step: every tree row, and the last row of each prompt done now
        hidden = out.hidden
        if chunks:  # (not on plain decode steps)
            ends = torch.tensor([end - r.prefilled for r, end in chunks], dtype=torch.long).cumsum(0) - 1 + tree_rows
            done = [i for i, (r, end) in enumerate(chunks) if end == len(r.prompt_ids)]
            hidden = hidden[to_device(torch.cat([torch.arange(tree_rows), ends[done]]), hidden.device)]
        logits = (
            self.model.logits(hidden, fp32=False) if hidden.shape[0] else hidden.new_empty(0, 0)
        )  # (only chunks of unfinished prompts)
        paths = self._verify_trees(reqs, trees, logits)
        firsts = self._first_tokens(chunks, logits[tree_rows:])
        results = self._to_host(paths + firsts)  # the step's one device-to-host copy
        events = self._accept(reqs, trees, tree_slots, out.captured, logits, results[: len(reqs)])
        events += self._prefilled(chunks, chunk_slots, logits[tree_rows:], out, tree_rows, results[len(reqs) :])
        if option is not None and not chunks:
            # NOTE: steps with a prompt in the forward are not measured: their seconds are not the trees'
            self.policy.observe(
                option,
                len(reqs),
                time.perf_counter() - t0,
                sum(len(e.new_tokens) for e in events),
                tree_rows,
                draft_seconds=t_drafted - t_propose,
                accepted=[e.accepted for e in events],
                drafted=[e.drafted for e in events],
            )
        return events

    def _keep_hidden(self, slots: list[torch.Tensor], captured: dict) -> None:
        """The step's captured layers at their rows' slots (the hidden store beside the prefix cache; device ops)."""
        if self._prefix_hidden is None:
            return
        at = to_device(torch.cat(slots), self.model.device)
        for l, h in captured.items():
            self._prefix_hidden[l][at] = h

    def _cached_hidden(self, r: Request):
        """cached_hidden(start) for a hit's drafter capture: the captured layers' rows of its cached tokens [start,
        m) from the hidden store, gathered on the device when the drafter asks (a drafter that kept its own state of
        them asks for few or none: gathering 1,500 rows of three layers costs ~10 ms on a CPU)."""
        store, slots = self._prefix_hidden, r.slots[: r.cached_tokens]
        if store is None or not r.cached_tokens:
            return None
        dev = self.model.device
        return lambda start: {l: rows[to_device(slots[start:], dev)] for l, rows in store.items()}

    @staticmethod
    def _to_host(items: list) -> list:
        """The step's one device-to-host copy: each AcceptedPath in `items` as a VerifyResult, in place;
        the other items (RequestFault, None, a host verifier's VerifyResult) as they are."""
        done = iter(to_host([p for p in items if isinstance(p, AcceptedPath)]))
        return [next(done) if isinstance(p, AcceptedPath) else p for p in items]

    def _prefilled(
        self,
        chunks: list[tuple[Request, int]],
        chunk_slots: list[torch.Tensor],
        logits: torch.Tensor,
        out,
        start: int,
        firsts: list,
    ) -> list[StepEvent]:
        """Commit each prompt chunk (its rows of the forward `out` from `start` on, chunk after chunk); a
        request whose prompt is now done gets its first token (firsts: per chunk, from _first_tokens after
        the step's copy; logits: one row per such request, in order) and starts drafting with the
        target's view of the whole prompt."""
        events, done = [], iter(range(logits.shape[0]))
        for (r, end), s, first in zip(chunks, chunk_slots, firsts):
            n = end - r.prefilled
            row = next(done) if end == len(r.prompt_ids) else None
            try:
                event = self._prefill_chunk(r, end, s, out, start, logits, row, first)
            except RequestFault as f:
                event = self._fail(r, f)
            if event is not None:
                events.append(event)
            start += n
        return events

    def _prefill_chunk(
        self,
        r: Request,
        end: int,
        s: torch.Tensor,
        out,
        start: int,
        logits: torch.Tensor,
        row: int | None,
        first: VerifyResult | RequestFault | None,
    ) -> StepEvent | None:
        """One prompt chunk: prompt tokens [r.prefilled, end) on rows `start`.. of `out`, slots `s`;
        row: the prompt's logits row once the prompt is done (then `first`: its first token), else None."""
        first_pos, n = r.prefilled, end - r.prefilled
        r.slots = torch.cat([r.slots, s])  # the chunk's slots are the request's from here on (freed with it)
        r.prefilled = end
        self._share(r, end)  # (requests arriving while this one runs hit its prompt)
        if r.params.prompt_logprobs is not None and (m := min(end, len(r.prompt_ids) - 1) - first_pos) > 0:
            # chunk row j (position first + j) predicts prompt token first + j + 1; the last
            # prompt row predicts the first output token (sampled below), not a prompt token
            with stage("logprobs"):
                rows = self.model.logits(out.hidden[start : start + m], fp32=False)
                tokens = r.prompt_ids[first_pos + 1 : first_pos + 1 + m]
                r.prompt_logprobs += token_logprobs(rows, tokens, r.params.prompt_logprobs)  # (a copy of its own)
        captured = out.captured
        if self.drafter is not None and captured:
            r.prompt_captured.append({l: h[start : start + n] for l, h in captured.items()})
        if row is None:
            return None
        if isinstance(first, RequestFault):
            raise first
        tok = first.tokens[0]
        self.running.append(r)
        if self.drafter is not None:
            parts, r.prompt_captured = r.prompt_captured, []
            hidden = {l: torch.cat([p[l] for p in parts]) for l in captured} if parts else {}
            positions = to_device(torch.arange(end), self.model.device)
            cap = TargetCapture(r.prompt_ids, positions, r.slots, hidden, self.kv, cached=r.cached_tokens)
            cap.cached_hidden = self._cached_hidden(r)
            self._drafter_call(lambda: self.drafter.add_request(r.rid, cap), [r])
        r.t_first_token = time.perf_counter()
        new = self._append(r, [tok])
        prompt_lps = r.prompt_logprobs if r.params.prompt_logprobs is not None else None
        return StepEvent(r, new, 0, 0, self._logprobs(r, logits, [row], new, first.logprobs), prompt_lps)

    def _first_tokens(self, chunks: list[tuple[Request, int]], logits: torch.Tensor) -> list:
        """Per chunk, on the device: a prompt done now gets its first token (an AcceptedPath, as a root-only
        tree's; logits: one row per such prompt, in order), or the RequestFault of that; others None."""
        done = [r for r, end in chunks if end == len(r.prompt_ids)]
        together = self._greedy_firsts(done, logits)
        out, rows = [], iter(range(logits.shape[0]))
        for r, end in chunks:
            if end < len(r.prompt_ids):
                out.append(None)
                continue
            row = next(rows)
            if row in together:
                out.append(together[row])
                continue
            try:
                out.append(self._with_logprobs(r, self._sample(logits[row], r), logits[row][None]))
            except RequestFault as f:
                out.append(f)
        return out

    def _greedy_firsts(self, done: list[Request], logits: torch.Tensor) -> dict[int, AcceptedPath]:
        """The first tokens of the plain greedy requests among `done` (logits: one row each, in order) by row,
        from one argmax over the rows (a fixed number of device ops, not a few per request); only with the
        engine's own _sample, and for requests that asked for no logprobs (the others go one by one)."""
        if type(self)._sample is not Engine._sample:
            return {}
        rows = [i for i, r in enumerate(done) if self._plain_greedy(r) and r.params.logprobs is None]
        if not rows:
            return {}
        try:
            toks = greedy_tokens(logits).view(-1, 1)  # [D, 1] (every row's: one op, whoever needs it)
            nodes, toks = torch.zeros_like(toks).unbind(0), toks.unbind(0)
            return {i: AcceptedPath(nodes[i], toks[i]) for i in rows}
        except Exception:  # noqa: BLE001 - then each request alone, in its own stage: a fault fails its request only
            log.warning("batched first tokens failed; sampling request by request", exc_info=True)
            return {}

    def _sample(self, logits: torch.Tensor, r: Request) -> AcceptedPath:
        """The first output token from the prompt's last row [V], on its device (no host read)."""
        if self._context_dependent(r):  # the first token: a root-only tree, no path
            logits = self._constrained(r, logits[None], root_tree(0, 0, logits.device))[0]
        with stage("sample"):
            if r.params.greedy:
                tok = greedy_tokens(logits)
            elif r.params.seed is not None:
                tok = seeded_token(logits_to_probs(logits, r.params), r.params.seed, len(r.prompt_ids))
            else:
                tok = draw(logits_to_probs(logits, r.params), r.generator)  # torch.multinomial's draw
            tok = tok.reshape(1)
            return AcceptedPath(torch.zeros_like(tok), tok)

    def _fail(self, r: Request, fault: RequestFault) -> StepEvent:
        """End one request after a fault in its own stage; the step's other requests carry on."""
        cause = fault.__cause__ or fault
        log.error("request %d failed in stage %r; the other requests carry on", r.rid, fault.reason, exc_info=cause)
        r.finish_reason, r.error = "error", fault.reason
        return StepEvent(r, [], 0, 0)

    def _drafter_call(self, fn, reqs: list[Request]):
        """Run a drafter call; on failure, the affected requests fall back to vanilla decoding."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - any drafter fault must not break the request
            self._fallback(reqs, type(e).__name__)
            return None

    def _fallback(self, reqs: list[Request], reason: str) -> None:
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

    def _propose(self, reqs: list[Request], shape: TreeShape | None) -> list[TokenTree]:
        """One tree per request; root-only (a plain decode step) when not drafting. (A drafted token
        outside the vocabulary is caught on the device: _verify_trees.)"""
        trees: dict[int, TokenTree] = {}
        drafting = [r for r in reqs if r.drafting and self.drafter is not None and shape is not None]
        inputs = [DraftInput(r.rid, r.token_ids, r.params, r.generator, r.reference, r.tenant) for r in drafting]
        if self._prediction is not None and any(r.reference for r in drafting):
            trees.update(self._prediction.trees(inputs, shape))
            # the model drafts the rest (and catches up later on the tokens it did not draft)
            drafting, inputs = [r for r in drafting if r.rid not in trees], [d for d in inputs if d.rid not in trees]
        if drafting:
            proposed = self._drafter_call(lambda: self.drafter.propose(inputs, shape), drafting)
            if proposed is not None:
                trees.update((r.rid, t) for r, t in zip(drafting, proposed) if t is not None)
        # the others' root-only trees all at once, on the target's device
        plain = [r for r in reqs if r.rid not in trees]
        roots = root_trees([r.output_ids[-1] for r in plain], [len(r.slots) for r in plain], self.model.device)
        trees.update((r.rid, t) for r, t in zip(plain, roots))
        return [trees[r.rid] for r in reqs]

    def _verify_trees(self, reqs: list[Request], trees: list[TokenTree], logits: torch.Tensor) -> list:
        """Each request's accepted path on its rows of the logits, on the device (or the RequestFault of
        its verification). A drafted tree's path carries whether the tree was a faulty drafter's (a token
        outside the vocabulary, never accepted; non-finite draft logits): the request falls back to
        vanilla decoding after the step's copy.
        Greedy requests whose rows are the raw logits (no penalties, min_tokens or grammar) are verified
        together (verify.greedy_paths: a fixed number of device ops for the step, not ~100 per request);
        the others one by one (_verify). A subclass's own _verify sees every request."""
        vocab = self.model.cfg.vocab_size
        starts = list(itertools.accumulate([t.num_nodes for t in trees], initial=0))
        wants_argmax = getattr(self.drafter, "wants_tree_argmax", False)
        together = [i for i, r in enumerate(reqs) if self._plain_greedy(r)] if self._batches_greedy() else []
        argmax = None  # [R] the target's argmax at every tree row, when some request reads it
        if together or (wants_argmax and any(r.drafting for r in reqs)):
            argmax = greedy_tokens(logits[: starts[-1]])
        paths: dict[int, AcceptedPath] = {}
        if together:
            try:
                found = greedy_paths([trees[i] for i in together], argmax, vocab, [starts[i] for i in together])
                paths = dict(zip(together, found))
            except Exception:  # noqa: BLE001 - then each request alone, in its own stage: a fault fails its request only
                log.warning("batched greedy verification failed; verifying request by request", exc_info=True)
        out = []
        for i, (r, t) in enumerate(zip(reqs, trees)):
            start, n = starts[i], t.num_nodes
            path = paths.get(i)
            if path is None:
                try:
                    path = self._verify(r, t, logits[start : start + n])
                except RequestFault as f:
                    path = f
                if n > 1 and isinstance(path, AcceptedPath):
                    invalid = ((t.draft_tokens < 0) | (t.draft_tokens >= vocab)).any()
                    path.draft_invalid = invalid if t.finite is None else invalid | ~t.finite
            if wants_argmax and r.drafting and isinstance(path, AcceptedPath):  # (its commit reads it: same copy)
                path.tree_argmax = argmax[start : start + n]
            if r.params.logprobs is not None:
                path = self._with_logprobs(r, path, logits[start : start + n])
            out.append(path)
        return out

    def _plain_greedy(self, r: Request) -> bool:
        """Whether the request verifies greedily on the raw logits (verify.greedy_paths may take it)."""
        return r.params.greedy and not self._context_dependent(r)

    def _batches_greedy(self) -> bool:
        """Whether plain greedy requests may be verified together: only with the engine's own _verify (a
        subclass that verifies its own way gets every request)."""
        return type(self)._verify is Engine._verify

    def _accept(
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
        if ok:
            grown = torch.cat([x for i in ok for x in (reqs[i].slots, keeps[i])])
            lens = [len(reqs[i].slots) + len(paths[i]) for i in ok]
            for i, s in zip(ok, grown.split(lens)):
                reqs[i].slots = s
        commits = self._commit_inputs(reqs, trees, results, paths, starts, captured)
        events = []
        for i, (r, t, res, path) in enumerate(zip(reqs, trees, results, paths)):
            if isinstance(path, RequestFault):
                events.append(self._fail(r, path))
                continue
            if res.draft_invalid:
                self._fallback([r], "invalid_draft")
            rows = [starts[i] + x for x in path]  # the path's rows of the step's logits
            events.append(self._advance(r, t, res, keeps[i], logits, rows, commits.get(i)))
        return events

    def _commit_inputs(
        self, reqs: list[Request], trees: list[TokenTree], results: list, paths: list, starts: list[int], captured: dict
    ) -> dict[int, tuple[torch.Tensor, dict]]:
        """For each request (by index) whose drafter commits this step: its accepted nodes' positions [k] and
        captured rows {layer: [k, H]} on the device, gathered for all of them at once (one index copied up,
        one index op per layer, then views per request). A drafter commits for a request that drafts and whose
        tree was valid (an invalid one's request falls back to vanilla decoding first)."""
        if self.drafter is None or not self._drafter_commits:
            return {}
        who = [
            i
            for i, (r, res, p) in enumerate(zip(reqs, results, paths))
            if r.drafting and not isinstance(p, RequestFault) and not res.draft_invalid
        ]
        if not who:
            return {}
        dev = self.model.device
        sizes = [len(paths[i]) for i in who]
        at = to_device(torch.tensor([starts[i] + x for i in who for x in paths[i]], dtype=torch.long), dev)
        positions = torch.cat([t.positions for t in trees])[at].split(sizes)  # the nodes' positions, as the forward's
        hidden = {l: h[at].split(sizes) for l, h in captured.items()}
        return {i: (positions[j], {l: rows[j] for l, rows in hidden.items()}) for j, i in enumerate(who)}

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
        captured rows when the drafter commits, from _commit_inputs)."""
        n = t.num_nodes
        self._record(r, res, n - 1)
        if commit is not None:
            positions, hidden = commit
            argmax = None if res.tree_argmax is None else torch.tensor(res.tree_argmax)  # (host values)
            tokens = [r.token_ids[-1]] + res.tokens[:-1]  # the root, then the accepted drafts: host values
            cap = TargetCapture(tokens, positions, keep, hidden, self.kv, argmax)
            self._drafter_call(lambda: self.drafter.commit(r.rid, cap), [r])
        try:
            new = self._append(r, res.tokens)
            # token i of the accepted path came from the target's logits at accepted node i
            lps = self._logprobs(r, logits, rows, new, res.logprobs)
            return StepEvent(r, new, res.num_accepted, n - 1, lps)
        except RequestFault as f:
            return self._fail(r, f)

    @staticmethod
    def _with_logprobs(r: Request, path, logits: torch.Tensor):
        """path (an AcceptedPath, on the device) with its tokens' logprobs when the request asked for them,
        computed on the device from the tree's raw logits [N, V] (they travel in the step's one copy), or
        the RequestFault of that; anything else as it is."""
        if r.params.logprobs is None or not isinstance(path, AcceptedPath):
            return path
        try:
            with stage("logprobs"):
                path_logprobs(path, logits, r.params.logprobs)
        except RequestFault as f:
            return f
        return path

    def _logprobs(
        self, r: Request, logits: torch.Tensor, rows: list[int], new: list[int], copied: list | None = None
    ) -> list[TokenLogprob] | None:
        """The new tokens' logprobs when the request asked: those that came in the step's copy (`copied`),
        else from the logits (rows: the logits row of each, in order; a copy of their own: a verifier
        that returned host results)."""
        if r.params.logprobs is None:
            return None
        with stage("logprobs"):
            lps = (
                copied[: len(new)]
                if copied is not None
                else token_logprobs(logits[rows[: len(new)]], new, r.params.logprobs)
            )
        r.output_logprobs += lps
        return lps

    def _context_dependent(self, r: Request) -> bool:
        """Whether the request's logits depend on each row's path (penalties, grammar, min_tokens)."""
        return r.params.penalized or r.matcher is not None or len(r.output_ids) < r.params.min_tokens

    def _constrained(self, r: Request, logits: torch.Tensor, tree: TokenTree) -> torch.Tensor:
        """The tree's rows under the request's penalties, min_tokens, then its grammar, each node after
        its own path. (Logprobs stay the raw ones: callers keep their rows.) Penalties and min_tokens are
        device ops; the grammar's bitmask is built by xgrammar on the host from the tree's tokens (a
        copy of its own, for requests with a grammar only)."""
        if r.params.penalized:
            with stage("penalty"):
                logits = penalize_tree(logits, r.params, r.prompt_ids, r.output_ids, tree)
        if len(r.output_ids) < r.params.min_tokens:
            with stage("mask"):
                logits = ban_early_stops(logits, tree, len(r.output_ids), r.params.min_tokens, self._stop_ids(r))
        if r.matcher is not None:  # after the penalties: a masked token stays impossible
            with stage("mask"):
                logits = apply_bitmask(logits, tree_bitmask(r.matcher, tree, logits.shape[-1]))
        return logits

    def _verify(self, r: Request, tree: TokenTree, logits: torch.Tensor) -> AcceptedPath | VerifyResult:
        """The request's accepted path on its tree's rows of the logits, on their device, no host read.
        (A subclass may verify on the host and return a VerifyResult; the step's copy passes it through.)"""
        if self._context_dependent(r):
            logits = self._constrained(r, logits, tree)
        with stage("verify"):
            if r.params.greedy:
                return greedy_path(tree, greedy_tokens(logits))
            probs = logits_to_probs(logits, r.params)
            if r.params.seed is not None:  # reproducible: plain seeded decoding's tokens, whatever was drafted
                return coupled_path(tree, probs, r.params.seed, len(r.slots))  # the root's position
            # a tree proposed under a shape gives a node at most shape.topk children (the sampled rounds)
            shape = self.last_shape
            return sampling_path(tree, probs, r.generator, shape.topk if shape is not None else None)

    def _record(self, r: Request, res: VerifyResult, drafted: int) -> None:
        st = r.stats
        st.verify_steps += 1
        st.draft_tokens += drafted
        st.accepted_tokens += res.num_accepted
        while len(st.accepted_by_depth) < res.num_accepted:
            st.accepted_by_depth.append(0)
        for i in range(res.num_accepted):
            st.accepted_by_depth[i] += 1

    def _stop_ids(self, r: Request) -> set[int]:
        """Tokens that end the request: EOS (unless ignore_eos) and its stop_token_ids."""
        return set(r.params.stop_token_ids) if r.params.ignore_eos else self.eos_ids | set(r.params.stop_token_ids)

    def _append(self, r: Request, tokens: list[int]) -> list[int]:
        """Append tokens, stopping at EOS/stop ids or max_new_tokens; return what was appended."""
        p = r.params
        stops = self._stop_ids(r)
        out = []
        for tok in tokens:
            out.append(tok)
            if tok in stops:
                r.finish_reason = "stop"
                break
            if len(r.output_ids) + len(out) >= p.max_new_tokens:
                r.finish_reason = "length"
                break
        r.output_ids += out
        if r.matcher is not None:
            with stage("grammar"):
                left = not all(r.matcher.accept_token(tok) for tok in out)
            if left:  # cannot happen (the mask allowed only matching tokens): end this request alone
                raise RequestFault("grammar")
        if not r.finished and len(r.token_ids) + self.tree.depth + 1 >= self.max_context:
            r.finish_reason = "length"
        return out

    # --- convenience --------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams) -> list[Request]:
        """Run a static batch to completion."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        try:
            while any(not r.finished for r in reqs):
                self.step()
        finally:
            for r in reqs:
                if not r.finished:
                    self.abort(r)
        return reqs


def build_engine(config: EngineConfig, target: Target | None = None, on_fallback=None) -> Engine:
    """The one place an engine is built from a config: load the target (unless one is given; on
    config.device), resolve the drafter ('auto': see resolve_drafter), build it, fill in its default
    tree, and build the Engine. `engine.config` is the resolved config (the drafter's name after
    'auto', the device, the tree), for labels and reports."""
    if target is None:
        device = resolve_device(config.device)  # cuda without CUDA fails here, before any weights are read
        target = load_target(config.model, dtype=config.dtype, device=device)
    else:
        device = str(target.model.device)
    name = resolve_drafter(config.drafter, target)
    config = replace(config, drafter=name, device=device, tree=config.tree or default_tree(name))
    return Engine(target, make_drafter(name, target), config, on_fallback=on_fallback)
