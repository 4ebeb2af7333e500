"""The embedded speculative engine: request -> prefill -> (draft -> tree -> verify -> accept)* -> done.

One step() advances every running request by one draft/verify cycle in a single batched target
forward; new requests are prefilled in that same forward. The vanilla path is the same loop with
root-only trees (one token per step), so speed ratios compare like with like.

The engine is its parts, each in the module a serving engineer looks for (docs/ARCHITECTURE.md):

    scheduler.py     Scheduler      waiting / running requests, chunked prefill, each step's batches
    kv_manager.py    KVManager      the target KV pool and the prefix cache over it (slots, hits, eviction)
    model_runner.py  ModelRunner    input assembly, graph replay or the eager forward, logits
    spec_worker.py   SpecWorker     propose -> verify -> accept -> advance over the drafter contract
    sampler.py       Sampler        a request's logits rules, verification and first token, logprobs, stops
    request.py       Request        a request's state, what a step did for it (StepEvent), its faults

Ownership: the engine owns requests and the target KV pool (through its KV manager); a drafter owns its
own state.

Faults: what is computed for one request alone (its penalties, masks, verification, sampling, logprobs,
grammar state) runs inside a `stage`; a fault there fails that request alone (finish_reason "error",
`Request.error` = the stage) and frees its KV, while the step's other requests carry on unchanged. A
fault outside every stage (the batched forward, the step's bookkeeping) fails the step; the caller
(the engine loop) then fails every request and calls `reset()`.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace

import torch

from sglang_ext.drafters import Drafter, default_tree, make_drafter, require_drafter, resolve_drafter
from sglang_ext.grammar import Grammars
from sglang_ext.models import Target, load_target, resolve_device
from sglang_ext.sampling import InvalidRequest, SamplingParams, token_logprobs
from sglang_ext.tree import TokenTree
from sglang_ext.verify import AcceptedPath, to_host

from .config import EngineConfig
from .decode_step import OverlappedLoop, replayed_step
from .kv_manager import KVManager
from .model_runner import ForwardBatch, ModelRunner
from .request import (  # (the request's data: callers import them from the engine too)
    CacheFlush,
    Request,
    RequestFault,
    RequestStats,
    SlotAccounts,
    StepEvent,
    fail,
    stage,
)
from .sampler import Sampler
from .scheduler import Scheduler
from .spec_worker import SpecWorker

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

    sampler_class = Sampler  # (a test's deliberately broken verifier is a Sampler subclass)
    spec_worker_class = SpecWorker

    def __init__(
        self, target: Target, drafter: Drafter | None = None, config: EngineConfig | None = None, on_fallback=None
    ):
        config = config or EngineConfig()
        drafter = require_drafter(drafter) if drafter is not None else None
        if config.tree is None:
            config = replace(config, tree=default_tree(drafter.name if drafter is not None else None))
        self.config, self.tree = config, config.tree
        self.target, self.model, self.drafter = target, target.model, drafter
        cap = self.model.cfg.max_position
        self.max_context = min(config.max_context or cap, cap)
        self.eos_ids = set(self.model.cfg.eos_token_ids)
        eos = getattr(target.tokenizer, "eos_token_id", None)
        if eos is not None:
            self.eos_ids.add(eos)
        self.grammars = Grammars(target.tokenizer, self.model.cfg.vocab_size, sorted(self.eos_ids))
        self._ids = itertools.count()
        self.capture_layers = tuple(drafter.capture_layers) if drafter else ()
        self.kv_manager = KVManager(
            self.model,
            config.kv_slots,
            config.prefix_cache,
            config.prefix_cache_tokens,
            self.capture_layers,
            keep_hidden=drafter is not None and drafter.reads_prefix_hidden,
            on_evict=drafter.drop_prefix if drafter is not None else None,
        )
        self.scheduler = Scheduler(config.prefill_tokens, config.prefill)
        self.runner = ModelRunner(self.model, self.kv_manager, self.capture_layers, config.cuda_graphs)
        self.sampler = self.sampler_class(self.eos_ids, self.max_context, self.tree.depth)
        self.spec = self.spec_worker_class(
            drafter, self.sampler, self.kv_manager, self.model, self.tree, config.adaptive, on_fallback
        )
        if self.runner.graph_runner is not None and drafter is not None and drafter.captures_steps:
            drafter.step_graphs = True  # a drafter with a captured step replays it too
        self.overlap = OverlappedLoop(self)  # steps issued before the last is read (config.overlap)

    # --- the parts' state, by the names callers read ---------------------------------------------
    @property
    def kv(self):
        """The target's KV pool."""
        return self.kv_manager.pool

    @property
    def prefix_cache(self):
        return self.kv_manager.cache

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def policy(self):
        """The adaptive speculation policy (None: the configured tree every step)."""
        return self.spec.policy

    @policy.setter
    def policy(self, policy) -> None:
        self.spec.policy = policy

    @property
    def on_fallback(self):
        """callback(request, reason) when a drafter fault sends a request back to vanilla decoding (metrics)."""
        return self.spec.on_fallback

    @on_fallback.setter
    def on_fallback(self, fn) -> None:
        self.spec.on_fallback = fn

    # --- admission ----------------------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        grammar: object | None = None,
        tenant: str = "",
        share: str | None = None,
    ) -> Request:
        """grammar: params.grammar compiled elsewhere (the server's compile workers); None: compiled here.
        tenant: the prefix cache's namespace (requests hit only their own tenant's prefixes); share: who the
        request belongs to for the scheduler's fairness (its API key's tenant; None: `tenant`)."""
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
        req = Request(
            next(self._ids), list(prompt_ids), params, gen, tenant=tenant, share=tenant if share is None else share
        )
        self.kv_manager.match_prefix(req)
        if params.grammar is not None:
            req.matcher = self.grammars.matcher(params.grammar if grammar is None else grammar)
        if params.prediction:  # NOTE: behind the prompt's tail, so the prediction's first tokens can be drafted
            req.reference = req.prompt_ids[-PREDICTION_HEAD:] + list(params.prediction)
        self.scheduler.add(req)
        return req

    def cached_prefix(self, prompt_ids: list[int], params: SamplingParams, tenant: str = "") -> tuple[int, int]:
        """(prompt tokens a request would take from the prefix cache now, how many of those no running request
        uses): the KV room admitting it takes is its prompt + outputs less the first, plus the second."""
        return self.kv_manager.peek(prompt_ids, params, tenant)

    def abort(self, req: Request) -> None:
        """Stop a request now and free its KV (e.g. the client went away)."""
        if not req.finished:
            req.finish_reason = "abort"
        self._release(req)

    def _release(self, req: Request) -> None:
        """The request's hold on the pool ends: its computed tokens go into the prefix cache (the drafter keeping
        its state of those the cache took, if it keeps any), the rest of its slots are freed. (A request that
        failed part-way through a chunked prefill is still waiting.)"""
        self.overlap.drop(req)  # (its work in a step in flight, if any, is never read)
        drafted = self.scheduler.remove(req) and self.drafter is not None and req.drafting
        self.runner.release(req)
        taken = self.kv_manager.cache_finished_req(req)
        if drafted:
            self.spec.end(req, taken)
        self.kv_manager.free_req(req)

    def flush_cache(self) -> CacheFlush:
        """Empty the prefix cache: tokens no request uses are freed now; those in use leave the cache (no request
        hits them again) and are freed when their last request ends."""
        return self.kv_manager.flush(self.scheduler.requests())

    def slot_accounts(self) -> SlotAccounts:
        """Where every slot of the pool is (between steps)."""
        return self.kv_manager.accounts(self.scheduler.requests())

    def reset(self) -> None:
        """Drop every request and leave the KV pool whole: after a fault no single request can be
        blamed for, the engine starts again from a clean state (the caller fails the requests; the
        prefix cache starts empty too)."""
        self.overlap.clear()
        for r in self.scheduler.held():
            if not r.finished:
                r.finish_reason, r.error = "error", "step"
            self._release(r)
        self.scheduler.clear()
        self.flush_cache()
        self.kv_manager.rebuild_if_leaked()

    # --- one step -----------------------------------------------------------------------------
    def step(self) -> list[StepEvent]:
        """Schedule, then per batch one target forward: draft -> KV slots -> forward -> verify -> one copy to the
        host -> accept (decoding requests) and prefilled (prompt chunks). In the overlapped loop (decode_step.py)
        a plain decode step's events come one Engine.step after its launch, the next step issued before them."""
        events = self.overlap.step()
        if events is None:
            events = []
            for reqs, chunks in self.scheduler.schedule(self.kv_manager.match_prefix):
                events += self._run(reqs, chunks)
        for e in events:
            if e.request.finished:
                self._release(e.request)
        self.scheduler.end_step()
        return events

    def _run(self, reqs: list[Request], chunks: list[tuple[Request, int]]) -> list[StepEvent]:
        """One forward for the running requests' trees and the arrivals' prompt chunks, side by side.
        Device rule: everything up to the verified paths and first tokens runs on the target's device and
        reads nothing back; `to_host` then copies every request's result at once (the step's one
        device-to-host copy, output logprobs included when asked) and the bookkeeping after it is host
        work. Prompt logprobs and grammar masks (built by xgrammar on the host) add reads of their own."""
        if not chunks and (events := replayed_step(self, reqs)) is not None:
            return events
        t0 = time.perf_counter()
        option, shape = self.spec.choose_shape(len(reqs))
        t_propose = time.perf_counter()
        trees = self.spec.propose(reqs, shape)
        t_drafted = time.perf_counter()
        batch = self._allocate(reqs, trees, chunks)
        try:
            out = self.runner.forward(batch)
        except BaseException:
            self._free(batch)  # a failed forward must not leak the trees' slots or the chunks'
            raise
        logits = self.runner.step_logits(out, batch)
        rows = batch.tree_rows
        paths = self.spec.verify(reqs, trees, logits, batch.greedy)
        firsts = self.sampler.first_tokens(chunks, logits[rows:])
        results = self._to_host(paths + firsts)  # the step's one device-to-host copy
        events = self.spec.accept(reqs, trees, batch.tree_slots, out.captured, logits, results[: len(reqs)])
        events += self._prefilled(batch, logits[rows:], out, results[len(reqs) :])
        if not chunks:  # NOTE: steps with a prompt in the forward are not measured: their seconds are not the trees'
            self.spec.observe(option, len(reqs), time.perf_counter() - t0, events, rows, t_drafted - t_propose)
        return events

    def _allocate(self, reqs: list[Request], trees: list[TokenTree], chunks: list) -> ForwardBatch:
        """KV slots for every tree (one alloc, tree after tree) and every prompt chunk, evicting from the prefix
        cache as needed; a failed alloc frees what the others took."""
        sizes = [t.num_nodes for t in trees]
        tree_slots, node_slots = self.kv_manager.alloc_split(sizes) if trees else (torch.empty(0, dtype=torch.long), ())
        batch = ForwardBatch(reqs, trees, tree_slots, node_slots, chunks, [])
        try:
            for r, end in chunks:
                batch.chunk_slots.append(self.kv_manager.alloc(end - r.prefilled))
        except BaseException:
            self._free(batch)
            raise
        return batch

    def _free(self, batch: ForwardBatch) -> None:
        for s in [batch.tree_slots, *batch.chunk_slots]:
            self.kv_manager.free(s)

    @staticmethod
    def _to_host(items: list) -> list:
        """The step's one device-to-host copy: each AcceptedPath in `items` as a VerifyResult, in place;
        the other items (RequestFault, None, a host verifier's VerifyResult) as they are."""
        done = iter(to_host([p for p in items if isinstance(p, AcceptedPath)]))
        return [next(done) if isinstance(p, AcceptedPath) else p for p in items]

    def _prefilled(self, batch: ForwardBatch, logits: torch.Tensor, out, firsts: list) -> list[StepEvent]:
        """Commit each prompt chunk (its rows of the forward `out` after the trees', chunk after chunk); a
        request whose prompt is now done gets its first token (firsts: per chunk, from Sampler.first_tokens
        after the step's copy; logits: one row per such request, in order) and starts drafting with the
        target's view of the whole prompt."""
        events, done, start = [], iter(range(logits.shape[0])), batch.tree_rows
        for (r, end), s, first in zip(batch.chunks, batch.chunk_slots, firsts):
            n = end - r.prefilled
            row = next(done) if end == len(r.prompt_ids) else None
            try:
                event = self._prefill_chunk(r, end, s, out, start, logits, row, first)
            except RequestFault as f:
                event = fail(r, f)
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
        first,
    ) -> StepEvent | None:
        """One prompt chunk: prompt tokens [r.prefilled, end) on rows `start`.. of `out`, slots `s`;
        row: the prompt's logits row once the prompt is done (then `first`: its first token, a VerifyResult
        or the RequestFault of it), else None."""
        first_pos, n = r.prefilled, end - r.prefilled
        r.slots = torch.cat([r.slots, s])  # the chunk's slots are the request's from here on (freed with it)
        r.prefilled = end
        self.kv_manager.cache_unfinished_req(r, end)  # (requests arriving while this one runs hit its prompt)
        if r.params.prompt_logprobs is not None and (m := min(end, len(r.prompt_ids) - 1) - first_pos) > 0:
            # chunk row j (position first + j) predicts prompt token first + j + 1; the last
            # prompt row predicts the first output token (sampled below), not a prompt token
            with stage("logprobs"):
                rows = self.runner.logits(out.hidden[start : start + m])
                tokens = r.prompt_ids[first_pos + 1 : first_pos + 1 + m]
                r.prompt_logprobs += token_logprobs(rows, tokens, r.params.prompt_logprobs)  # (a copy of its own)
        self.spec.keep_prompt_capture(r, out.captured, start, n)
        if row is None:
            return None
        if isinstance(first, RequestFault):
            raise first
        self.scheduler.start_decoding(r)
        self.spec.start(r, out.captured)
        r.t_first_token = time.perf_counter()
        new = self.sampler.append(r, [first.tokens[0]])
        prompt_lps = r.prompt_logprobs if r.params.prompt_logprobs is not None else None
        return StepEvent(r, new, 0, 0, self.sampler.logprobs(r, logits, [row], new, first.logprobs), prompt_lps)

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
