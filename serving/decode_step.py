"""A plain decode step replayed whole: no drafter, no prompt chunk, a graph bucket, every request greedy on the raw
logits without logprobs, or, in the overlapped loop, greedy or sampled under its penalties and min_tokens, with
logprobs or not (see below). One new KV slot per request, one graph replay (the forward, the logits and each row's
token; the prefixes from the graph runner's slot table on the device: models/decode_graphs.py), the tokens (and
the logprobs asked for) in the step's one device-to-host copy, the slots appended (one cat for the batch, each
request's a view of it). It gives the tree path's tokens (a root-only tree's path is its root, its token the
target's there: the argmax, or a sampled request's coupled sample) in a fixed number of host ops for the batch
(moa_serve/benchmarks/step_ops.py counts them).

The overlapped loop (SGLang's overlap scheduler, vLLM's async scheduling; `EngineConfig.overlap`, where the
runner's stream is asynchronous: CUDA) issues step N+1 before it reads step N's tokens, so the host's work
for a step (the wait for its copy, stops, events, then the next step's slots and upload) runs while the
device computes the next one:

    host:    launch 1, launch 2, read 1 | launch 3, read 2 | launch 4, read 3 | ...     (one Engine.step each)
    device:  [ step 1 ][ step 2 ............ ][ step 3 ......... ][ step 4 ...

Step N+1's rows read step N's tokens where the device left them (models/decode_graphs.py's future tokens: -1 - i,
row i of the previous step), its slots are allocated and appended to the requests at launch, and each
step's tokens still come up in one copy (queued behind the step, read after the next is issued). A request
that step N ends (EOS, a stop id, its length, a fault of its own) or that is aborted before step N+1 is read
was launched in step N+1 too: that step's token for it is dropped unread and its slot freed, so its output,
slots, stats and what the prefix cache takes are those of the loop without overlap. Drafted steps chain the
same way (serving/spec_step.py: greedy and sampled requests); the loop keeps one step in flight, of either kind.

Arrivals end no chain: their prompt chunks (chunked prefill, prefix cache hits) run in a forward of their own,
issued with their first tokens' copy (with the logprobs of those that ask: the raw logits', as the ordinary step's)
before the step in flight is read (`launch_prefill`: the host takes the chunks
at launch), then step N+1 of the running requests; the prefill's copy is read first (behind step N on the device),
the drafter settles the new prompts' state (Drafter.settle: EAGLE-3's draft-extend of the prompt's pairs, MoA's
commit), then step N. A new request joins the chain from the next step: a plain decode row reading its first token
from the host, or a drafting row whose drafter state joins from the futures (spec_step: Drafter.join_chained):

    host:    launch P, launch N+1, read P, read N | launch N+2 (+ the new rows), read N+1 | ...
    device:  [ step N ][ P ][ step N+1 ............ ][ step N+2 ...

A request step N ends while P and step N+1 are issued is dropped from step N+1 as above; P only prefills arrivals.

Sampled requests (a temperature, top_k / top_p or not, seeded or not) chain beside greedy ones: the graph takes each
row's sampling parameters as inputs and gives a sampled row its coupled sample (sampling.coupled_tokens: Gumbel-max
with the (seed, position) noise, the chained spec verify's ops), which is the token the ordinary step's verify gives a
seeded request's root-only tree (verify.coupled_path), so a seeded request's output is the loop without overlap's; an
unseeded one's seed is made from its generator's (Sampler.coupling_seed), as in chained spec steps: each token an
exact sample of the target given the text before it, where its ordinary steps draw from its generator.

Requests with penalties (frequency, presence, repetition, a logit bias) or min_tokens still ahead chain too, greedy or
sampled: the graphs apply them to each row's logits as the ordinary step's host path does (Sampler.constrained), from
state on the device that each chained step brings up to its root from the step before's tokens, unread
(models/penalty_graphs.py); an arrival's first token takes them on the device in its prefill (Sampler.sample).

Requests that ask for logprobs (top_logprobs or not) chain too, greedy or sampled, penalized or not, beside requests
that ask for none: the graph takes each row's logprob and its K likeliest (K: the batch's widest top_logprobs
bucketed as the chained spec verify's, spec_step.top_bucket; a graph per K) from the raw logits, as the ordinary
step's verify.path_logprobs, with the chained spec verify's ops for a root-only row (models/decode_graphs.py), and
they come up with the tokens in the step's one copy (`finish`: spec_graphs.path_logprobs_of), so they are the loop
without overlap's (its ordinary step's).

Arrivals that ask for the logprobs of their prompt ride too: the prefill takes them from the chunks' rows with the
ordinary step's values (spec_graphs.graph_path_logprobs over each chunk's rows: token_logprobs') into its one copy.

Arrivals that need host reads of their own (a grammar, a predicted output) and steps that are neither kind (a plain
decode step with a request that has a grammar, a batch outside the buckets, a drafting request the drafter cannot
join) first read the step in flight, alone in its Engine.step when it brings tokens; the ordinary step runs after it,
once every piece of work the loop issued has run (OverlappedLoop.drain: work issued after the step's copy, such as a
drafter's settle of arrivals, included). Without overlap a plain decode step takes plain greedy requests without
logprobs only (the ordinary step draws a sampled request's tokens, applies penalties on the host and takes logprobs)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from sglang_ext.attention import causal_mask
from sglang_ext.device import HostCopy, grow, to_device
from sglang_ext.models.spec_graphs import graph_path_logprobs, path_logprobs_of
from sglang_ext.sampling import float_bits
from sglang_ext.verify import AcceptedPath, tokens_to_host

from . import spec_step
from .request import Request, RequestFault, StepEvent, fail, stage
from .sampler import Sampler
from .spec_worker import SpecWorker


def replayed_step(engine, reqs: list[Request]) -> list[StepEvent] | None:
    """A step of these decoding requests (no prompt chunk) replayed whole and read at once: a plain greedy decode
    step, or a chained spec step where the overlapped loop applies (spec_step.py); None: neither ran (the engine's
    ordinary step runs)."""
    if plain_decode(engine, reqs):
        return decode_step(engine, reqs)
    return spec_step.spec_step(engine, reqs) if spec_step.spec_chains(engine, reqs) else None


def plain_decode(engine, reqs: list[Request]) -> bool:
    """Whether a step of these decoding requests (no prompt chunk) takes `decode_step`."""
    return (
        engine.runner.graph_runner is not None  # (first: on the CPU no step takes this path)
        and engine.drafter is None
        and type(engine.sampler) is Sampler
        and type(engine.spec) is SpecWorker
        and all(_in_graph(engine, r) and (r.params.logprobs is None or engine.overlap.applies()) for r in reqs)
        and engine.runner.can_decode(reqs)
    )


def _in_graph(engine, r: Request) -> bool:
    """Whether the graph's token is the request's: greedy on the raw logits, or, in the overlapped loop, greedy or
    sampled (seeded or not, top_k / top_p or not) under its penalties and min_tokens, which the graph applies (its
    coupled sample: models/decode_graphs.py; the penalties' state on the device lasts a chain, models/penalty_graphs.py;
    a step read at once would write it from the host every step, so without overlap the ordinary step takes them).
    Not a grammar's (its mask is the host's)."""
    return engine.sampler.plain_greedy(r) or (engine.overlap.applies() and r.matcher is None)


@dataclass
class Launched:
    """A plain decode step issued to the device, its tokens not read yet."""

    reqs: list[Request]
    slots: list[torch.Tensor]  # per request its new slot [1] int64 host id (appended to r.slots at launch)
    tokens: HostCopy | list  # [B] the step's tokens (with top: [B, 2 + 2K] rows, each its token then its
    # logprobs: models/decode_graphs.py): queued to the host (an asynchronous stream), or read
    live: dict[int, int]  # rid -> row: the requests whose token is read (a request that ended since: dropped)
    top: int | None = None  # K: the widest top_logprobs its requests ask for (None: none asks for logprobs)


def decode_step(engine, reqs: list[Request]) -> list[StepEvent]:
    """The step (see the module docstring) for the engine's decoding requests, read at once."""
    return finish(engine, launch(engine, reqs))


def launch(engine, reqs: list[Request], prev: Launched | None = None) -> Launched:
    """Issue a plain decode step of `reqs` (slots allocated and appended, the graph replayed, its tokens' copy
    queued); prev: the step in flight, whose tokens the requests it holds read on the device."""
    kv = engine.kv_manager
    slots = kv.alloc(len(reqs))
    rows = prev.live if prev is not None else {}
    tokens = [-1 - rows[r.rid] if r.rid in rows else r.output_ids[-1] for r in reqs]
    top = spec_step.top_bucket([r.params.logprobs for r in reqs if r.params.logprobs is not None])
    try:
        rules = [engine.sampler.penalty_row(r) for r in reqs], engine.sampler.graph_sampling(reqs)
        out = engine.runner.decode(reqs, slots, tokens, *rules, top)
        stream = engine.runner.stream
        copy = stream.to_host(out) if stream.asynchronous else tokens_to_host(out)  # the step's one copy
    except BaseException:
        kv.free(slots)
        raise
    new = list(slots.split(1))
    for r, s in zip(reqs, grow([r.slots for r in reqs], new)):
        r.slots = s
    return Launched(reqs, new, copy, {r.rid: i for i, r in enumerate(reqs)}, top)


def finish(engine, step: Launched, following: Launched | None = None) -> list[StepEvent]:
    """Read a launched step's tokens and append them to its live requests; following: the step launched after
    it, where a request this step ends has its token dropped and its slot freed (`drop`)."""
    tokens = step.tokens if isinstance(step.tokens, list) else step.tokens.wait()
    events = []
    for r, row in zip(step.reqs, tokens):
        if r.rid not in step.live:  # (it ended before this step was read: a surplus token)
            continue
        r.stats.verify_steps += 1
        tok = row if step.top is None else row[0]
        try:
            new = engine.sampler.append(r, [tok])
            lps = None
            if r.params.logprobs is not None:  # (its k of the K likeliest, after the token: column 1 on)
                lps = path_logprobs_of(row, 1, step.top, [tok], r.params.logprobs, at=1)
            events.append(StepEvent(r, new, 0, 0, engine.sampler.logprobs(r, None, [], new, lps)))
        except RequestFault as f:
            events.append(fail(r, f))
        if r.finished and following is not None:
            drop(engine, following, r)
    return events


def drop(engine, step: Launched, r: Request) -> None:
    """r ended before the launched `step` is read: its token there is never read and its slot there (the last of
    r.slots) goes back to the pool. (On the device the step may still write that slot; whatever takes it next is
    issued after, so it writes it later.)"""
    i = step.live.pop(r.rid, None)
    if i is not None:
        r.slots = r.slots[:-1]
        engine.kv_manager.free(step.slots[i])


@dataclass
class Prefill:
    """Arrivals' prompt chunks issued to the device while a step is in flight, their first tokens not read yet."""

    chunks: list[tuple[Request, int]]  # (request, end): its prompt tokens [prefilled, end) (prefilled at launch)
    firsts: HostCopy | None  # [D + L + P] the first token of each prompt done by its chunk, -1 where it faulted,
    # the logprobs of those asked (L: _logprob_columns'), then the prompt logprobs asked (P: _prompt_columns');
    # None: nothing to read
    out: dict = field(default_factory=dict)  # filled on the device: "captured" {layer: [R, H]}, "faults" {i: fault},
    # "prompt_faults" {rid: fault} (its prompt logprobs faulted: that request fails)
    at: list[int] = field(default_factory=list)  # per done prompt: where its first token's logprobs start (-1: none)
    prompt: list[PromptLogprobs] = field(default_factory=list)  # the chunks whose prompt logprobs are asked


@dataclass
class PromptLogprobs:
    """A prompt chunk's logprobs of its prompt tokens, taken in an arrivals' prefill (as the ordinary step's
    Engine._prefill_chunk: chunk row j predicts prompt token first + j + 1, the prompt's last row none)."""

    r: Request
    row: int  # its first row in the prefill's forward
    tokens: list[int]  # the prompt tokens its rows predict
    at: int  # where their columns start in the prefill's copy (graph_path_logprobs' of a path of its rows)


def prefill_rides(engine, waiting) -> bool:
    """Whether the arrivals' prompts can be prefilled while a step is in flight (`launch_prefill`): first tokens
    drawn on the device (penalties and min_tokens there too: device ops on the empty output; no grammar, whose mask
    the host builds), their logprobs and the prompt's with them, no predicted output."""
    return type(engine.sampler) is Sampler and all(r.matcher is None and not r.reference for r in waiting)


def _logprob_columns(done: list[Request]) -> tuple[list[int], int]:
    """(per done prompt, where its first token's logprobs start in the prefill's copy, -1 where it asks none; the
    columns they take): after the D first tokens, per prompt that asks top_logprobs k, 1 + 2k columns: its
    token's logprob, the k likeliest's (their fp32 bits: sampling.float_bits) and their ids."""
    at, n = [], len(done)
    for r in done:
        k = r.params.logprobs
        at.append(-1 if k is None else n)
        n += 0 if k is None else 1 + 2 * k
    return at, n - len(done)


def _prompt_columns(chunks: list[tuple[Request, int]], rows: list[int], at: int) -> tuple[list[PromptLogprobs], int]:
    """(the chunks that take prompt logprobs, the copy's width): rows: each chunk's first row in the forward; at: the
    copy's first free column; each such chunk takes m * (1 + 2k) columns (m: its rows that predict a prompt token, k:
    its top alternatives)."""
    out = []
    for (r, end), row in zip(chunks, rows):
        k, first = r.params.prompt_logprobs, r.prefilled
        if k is not None and (m := min(end, len(r.prompt_ids) - 1) - first) > 0:
            out.append(PromptLogprobs(r, row, r.prompt_ids[first + 1 : first + 1 + m], at))
            at += m * (1 + 2 * k)
    return out, at


def launch_prefill(engine, chunks: list[tuple[Request, int]]) -> Prefill:
    """Issue one forward of the arrivals' prompt chunks (as the ordinary step's chunks: their K/V written, the captured
    layers kept beside the prefix cache) and each done prompt's first token, and queue those tokens' copy; the host
    takes the chunks now (the requests' slots, prefilled counts and prefix cache entries), nothing is read."""
    kv, runner, stream = engine.kv_manager, engine.runner, engine.runner.stream
    slots = engine._allocate([], [], chunks).chunk_slots  # (a failed alloc frees what the others took)
    sizes = [end - r.prefilled for r, end in chunks]
    ids = [torch.tensor(r.prompt_ids[r.prefilled : end]) for r, end in chunks]
    pos = [torch.arange(r.prefilled, end) for r, end in chunks]
    masks = [causal_mask(n, r.prefilled) for (r, _), n in zip(chunks, sizes)]
    prefixes = [r.slots for r, _ in chunks]
    ends = torch.tensor(sizes).cumsum(0) - 1
    last = ends[[i for i, (r, end) in enumerate(chunks) if end == len(r.prompt_ids)]]  # [D] the done prompts' rows
    step = Prefill(list(chunks), None)
    step.at, extra = _logprob_columns([r for r, end in chunks if end == len(r.prompt_ids)])
    captures = [(r, start - n + 1, n) for (r, _), n, start in zip(chunks, sizes, ends.tolist())]
    step.prompt, width = _prompt_columns(chunks, [start for _, start, _ in captures], len(last) + extra)
    firsts = torch.full((width,), -1, dtype=torch.long, device=engine.model.device)
    asked = [(p, torch.tensor(p.tokens)) for p in step.prompt]

    def arrivals_prefill() -> None:  # (device work: on an asynchronous stream it runs after what was issued before)
        out = runner.forward_rows(ids, pos, slots, prefixes, masks)
        kv.store_hidden(slots, out.captured)
        step.out["captured"], step.out["faults"], step.out["prompt_faults"] = out.captured, {}, {}
        for r, start, n in captures:
            engine.spec.keep_prompt_capture(r, out.captured, start, n)
        for p, tokens in asked:  # (the ordinary step's rows and ops: Engine._prefill_chunk, sampling.token_logprobs)
            try:  # (a fault here fails that request alone, as in the ordinary step)
                with stage("logprobs"):
                    rows = runner.logits(out.hidden[p.row : p.row + len(p.tokens)])[None]  # [1, m, V]: a path of them
                    path = to_device(tokens, rows.device)[None]
                    at = torch.arange(len(p.tokens), device=rows.device)[None]
                    flat = torch.cat(graph_path_logprobs(rows, at, path, p.r.params.prompt_logprobs), 1)[0]
                    firsts[p.at : p.at + flat.numel()].copy_(flat)
            except RequestFault as f:
                step.out["prompt_faults"][p.r.rid] = f
        if len(last):
            firsts_of = engine.sampler.first_tokens(step.chunks, runner.logits(out.hidden[last.to(out.hidden.device)]))
            done = [x for x in firsts_of if x is not None]
            for i, x in enumerate(done):
                if isinstance(x, AcceptedPath):
                    firsts[i : i + 1].copy_(x.tokens[:1])
                    if x.logprobs is not None:  # (chosen [1], the k likeliest [1, k], their ids [1, k])
                        chosen, vals, top = x.logprobs
                        flat = torch.cat([float_bits(chosen), float_bits(vals[0]), top[0]])
                        firsts[step.at[i] : step.at[i] + flat.numel()].copy_(flat)
                else:
                    step.out["faults"][i] = x

    stream.launch(arrivals_prefill)
    if width:
        step.firsts = stream.to_host(firsts)  # the prefill's one device-to-host copy
    for (r, end), s in zip(chunks, slots):
        r.slots = torch.cat([r.slots, s])  # the chunk's slots are the request's from here on (freed with it)
        r.prefilled = end
        kv.cache_unfinished_req(r, end)  # (an arrival that hits them is prefilled after this one, on the device too)
    return step


def finish_prefill(engine, step: Prefill) -> list[StepEvent]:
    """Read a launched prefill's first tokens: each prompt done starts decoding (the drafter starts on it and, where
    it chains, settles its prompt so that the request joins the chain in flight: Drafter.settle)."""
    row = step.firsts.wait() if step.firsts is not None else []
    faults, events, started = step.out.get("faults", {}), [], []
    bad = step.out.get("prompt_faults", {})  # {rid: RequestFault}: its prompt logprobs faulted (the request fails)
    for p in step.prompt:  # (their columns: a path of width m, K = k: spec_graphs.path_logprobs_of)
        k = p.r.params.prompt_logprobs
        if p.r.rid not in bad:
            p.r.prompt_logprobs += path_logprobs_of(row, len(p.tokens), k, p.tokens, k, at=p.at)
    events += [fail(r, bad[r.rid]) for r, end in step.chunks if end < len(r.prompt_ids) and r.rid in bad]
    for i, r in enumerate(r for r, end in step.chunks if end == len(r.prompt_ids)):
        tok = row[i]
        try:
            if r.rid in bad:
                raise bad[r.rid]
            if tok < 0:
                raise faults[i]
            engine.scheduler.start_decoding(r)
            engine.spec.start(r, step.out["captured"])
            r.t_first_token = time.perf_counter()
            new = engine.sampler.append(r, [tok])
            k = r.params.logprobs  # (its columns: graph_path_logprobs' of a one-node path of width 1 and K = k)
            lps = None if step.at[i] < 0 else path_logprobs_of(row, 1, k, [tok], k, at=step.at[i])
            prompt_lps = r.prompt_logprobs if r.params.prompt_logprobs is not None else None
            events.append(StepEvent(r, new, 0, 0, engine.sampler.logprobs(r, None, [], new, lps), prompt_lps))
        except RequestFault as f:
            events.append(fail(r, f))
        if not r.finished and r.drafting and engine.drafter is not None:
            started.append(r)
    d = engine.drafter
    if started and d.chains:
        inputs = [r.draft_input() for r in started]
        engine.spec.call(lambda: d.settle(inputs), started)
    return events


class OverlappedLoop:
    """The engine's overlapped loop (the module docstring): the step in flight, if any: a plain decode step, or a
    drafter's chained spec step (serving/spec_step.py: the same loop for drafted steps)."""

    def __init__(self, engine):
        self.engine = engine
        self.inflight: Launched | spec_step.Chained | None = None

    def applies(self) -> bool:
        stream = self.engine.runner.stream
        return self.engine.config.overlap and stream is not None and stream.asynchronous

    def step(self) -> list[StepEvent] | None:
        """This Engine.step's events when the loop takes it; None: the caller runs the step as usual (no step is
        in flight then)."""
        eng, prev = self.engine, self.inflight
        running, waiting = eng.scheduler.running, eng.scheduler.waiting
        kind = None  # (the module whose steps chain now)
        if self.applies() and running and (not waiting or prefill_rides(eng, waiting)):
            if plain_decode(eng, running):
                kind = PLAIN
            elif spec_step.chain_next(eng, running, prev if isinstance(prev, spec_step.Chained) else None):
                kind = spec_step  # (with the adaptive policy: its option chosen for the step, the tree in flight)
        if kind is None or (prev is not None and not isinstance(prev, kind.Launched)):
            self.inflight = None
            if prev is not None and (events := self._finish(prev)):
                return events  # (read alone: the ordinary step runs at the next Engine.step, drained there)
            self.drain()  # (only surplus tokens, or nothing in flight: the ordinary step runs now)
            return None
        # (the running requests' decode, and the arrivals' chunks: the scheduler's state kept as every step's)
        reqs, batches = list(running), eng.scheduler.schedule(eng.kv_manager.match_prefix)
        chunks = [c for _, cs in batches for c in cs]
        # NOTE: the arrivals' prefill is issued before the step in flight is read, and its first tokens are read
        # before that step is: the drafter settles their prompts before the step's read frees slots whose writes
        # the step after it may still have queued (so what it takes is written after those)
        arrived = launch_prefill(eng, chunks) if chunks else None
        firsts = lambda: finish_prefill(eng, arrived) if arrived is not None else []  # noqa: E731
        if prev is None:
            prev = self.inflight = kind.launch(eng, reqs)
            if prev is None:  # (a drafter fault: its requests decode without it from now on)
                return firsts()
            if eng.spec.policy is not None and not spec_step.chain_next(eng, reqs, prev):
                self.inflight = None  # (the policy chose another option for the step after: read this one alone)
                return firsts() + spec_step.finish(eng, prev)
        self.inflight = kind.launch(eng, reqs, prev)  # NOTE: step N+1 issued before step N's tokens are read
        events = firsts()
        return kind.finish(eng, prev, self.inflight) + events

    def drain(self) -> None:
        """Before an ordinary step: every piece of device work the loop issued has run. NOTE: reading the step in
        flight waits for its copy only; work issued after that copy (a drafter's settle of arrivals, a chain's last
        commit) may still be queued, and the ordinary step's host reads (its copy, prompt logprobs, a drafter's) must
        not count on a read of their own to wait for it (a pinned copy, an event, waits for less)."""
        if self.applies():
            self.engine.runner.stream.synchronize()

    def _finish(self, step) -> list[StepEvent]:
        return (spec_step if isinstance(step, spec_step.Chained) else PLAIN).finish(self.engine, step)

    def drop(self, r: Request) -> None:
        """r ends now (an abort, a release): its token in the step in flight is dropped and its slot freed."""
        if self.inflight is not None:
            (spec_step if isinstance(self.inflight, spec_step.Chained) else PLAIN).drop(self.engine, self.inflight, r)

    def clear(self) -> None:
        """After a step fault: nothing in flight (the device's work issued so far is waited for, faults ignored)."""
        self.engine.spec.chosen = None
        step, self.inflight = self.inflight, None
        try:
            self.drain()  # (work issued after the step in flight's copy too)
        except Exception:  # noqa: BLE001 - the engine is starting again from a clean state
            pass
        if isinstance(step, spec_step.Chained):  # (its trees' slots are held by the step alone)
            spec_step.clear(self.engine, step)


class PLAIN:
    """This module's plain decode steps, as the loop chains them (spec_step's functions have the same names)."""

    Launched, launch, finish, drop = Launched, staticmethod(launch), staticmethod(finish), staticmethod(drop)
