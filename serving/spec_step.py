"""A drafted step whose accept results stay on the device (SGLang's spec v2), for the overlapped loop
(serving/decode_step.py; `EngineConfig.overlap`, where the runner's stream is asynchronous): a drafter that
chains (`chains`: EAGLE-3 and MoA, their greedy searches static) drafts step N+1 from step N's accepted path
where the device left it, so step N+1 (the drafter's commit of step N's accepted tokens and its search in one
graph: EAGLE-3's draft-extend, MoA's LSA, CA and SA commit; the verify in another) is issued before the host
reads step N:

    host:    launch 1, launch 2, read 1 | launch 3, read 2 | ...          (one Engine.step each)
    device:  [commit+search 1][verify 1][commit+search 2][verify 2] ...

Step N's verify leaves each request's path length, tokens, target slots and captured features on the device
(models/spec_graphs.py: SpecFuture); step N+1's graphs read them there (the slot table's prefix from base + L,
the commit's L rows of W = depth + 1, the search's root the bonus token and its prefixes L longer). Each step
still has one device-to-host copy: its [b, 2W + 1] result (path nodes, tokens, the faulty-drafter flag), read one
step behind. Where requests ask for logprobs, the verify takes their paths' logprobs and top
alternatives from its logits inside its graph, as the ordinary step does (verify.path_logprobs), and they come up in
the same copy (each result row longer: spec_graphs.path_logprobs_of); the others in the batch ignore theirs.

Sampled requests (a temperature, top_k / top_p or not, seeded or not) ride beside greedy ones: the verify is coupled
(verify.py), each sampled row's token at a node its Gumbel-max sample with the (seed, position) noise, inside the
graph (spec_graphs: the rows' parameters are its inputs), so a seeded request's output is plain seeded decoding's
as in the ordinary step (Sampler.verify: coupled_path, the same noise); an unseeded one is verified with a seed made
from its generator's (Sampler.coupling_seed): an exact sample of the target's law at each position, as its ordinary
steps' speculative sampling. The drafter's search sees them as greedy (`_searched`): deterministic trees, the argmax
chain for a chain, the proposal coupled verification takes (no draft probabilities). A greedy row's token is the
argmax, as without sampled rows.

The host catches up when it reads step N (`finish`): the accepted nodes' target slots join their requests (the
rest freed), the stats, the tokens and stops, the drafter's slots of step N+1's commit trimmed to the L rows that
were real (`commit_chained`) and the slot tables' accounts. A request that step N ends (EOS, a stop id, its
length, a fault of its own) or that is aborted meanwhile was launched in step N+1 too: that step's result for it
is dropped unread, its tree's slots and its drafter state there freed, so its output, slots, stats and what the
prefix cache and the drafter keep are those of the loop without overlap. A step that ends a chain (nothing
issued after it) hands the drafter its accepted path as an ordinary commit (EAGLE-3: with its features).

A request that arrived while a chain ran (decode_step.py: its prefill issued beside the step in flight) joins the
chain at its first decode step as a drafting row: with no row in the step before, the drafter writes what its commit
takes of it into a row of the futures that no verify wrote (Drafter.join_chained, after Drafter.settle processed its
prompt: EAGLE-3 the root pair, one real commit row; MoA nothing to commit, the root token) and commits those rows at
launch; the verify takes its prefix from the host. Where the drafter cannot (a prompt its buckets do not fit, no
spare row), the chain ends.

A request that does not draft (its drafter failed: `Request.drafting` off) rides in a chained step as a root-only
row, so that the others keep chaining: its tree is its root (the bonus token of its row in the step before, on the
device, or its last token where it has none there: the request that fell back when step N was read, its drafted tree
in step N+1 dropped unread) and N - 1 padding rows that no node sees, its path the root, its token the target's
there (the argmax, or a sampled request's coupled sample); no drafter state. A batch where no request drafts takes
the ordinary step.

Under the adaptive policy the loop chooses step N+1's option before step N is read (`chain_next`): the same tree
chains, another option (off, another tree) ends the chain; each chained step is observed when it is read (`_observe`).
Requests with penalties or min_tokens still ahead ride beside the others, greedy or sampled, drafting or root-only:
the verify's graph takes each tree row's logits under its request's penalties (the output's counts and the row's own
path below the root: penalties.py) and bans its stop tokens at the rows that choose an output token before number
min_tokens, as Sampler.constrained does in the ordinary step, with the same ops (penalties.penalize_rows, ban_rows);
the tokens then follow as above. Their state (output counts, length, prompt tokens, bias, stop tokens) lives on the
device per slot table row, each step adding the path of the step before from the futures (models/penalty_graphs.py).

Arrivals end no chain (decode_step.py). Lookup drafters, requests with a grammar (its mask is built on the host),
predicted outputs, arrivals that need host reads (decode_step: prefill_rides) and steps outside the graph buckets take
the engine's ordinary step; the step in flight is read first (decode_step.OverlappedLoop).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from sglang_ext.device import HostCopy, grow, to_device
from sglang_ext.drafters import TargetCapture
from sglang_ext.models.spec_graphs import WIDTH, path_logprobs_of, spec_future, verify_bucket, verify_spec
from sglang_ext.sampling import MAX_TOP_LOGPROBS, SamplingParams
from sglang_ext.tree import TreeShape
from sglang_ext.verify import VerifyResult

from .request import Request, RequestFault, StepEvent, fail
from .sampler import Sampler
from .spec_worker import SpecWorker


def spec_chains(engine, reqs: list[Request], prev: "Chained | None" = None) -> bool:
    """Whether a step of these decoding requests (no prompt chunk) is a chained spec step at the configured tree, no
    adaptive policy (after `prev`, the chained step in flight, when given: then every drafting request must be in
    it)."""
    return engine.spec.policy is None and _eligible(engine, reqs, prev) and _fits(engine, reqs, engine.spec.tree, prev)


def chain_next(engine, reqs: list[Request], prev: "Chained | None" = None) -> bool:
    """Whether the overlapped loop's next step of these requests is a chained spec step (after `prev`, as in
    spec_chains). With the adaptive policy its option is chosen here, before `prev` is read (the policy's stats one
    step behind), and kept in SpecWorker.chosen for the step that runs next: a chained one when it is the tree of
    the step in flight (a chain's first: any tree, after a drafted step, so that the policy's unrated step after
    steps without drafting is never a chained one) and the chain fits; otherwise the step in flight is read first
    and the ordinary step runs with it (the chain ends)."""
    spec = engine.spec
    if spec.policy is None:
        return spec_chains(engine, reqs, prev)
    if not _eligible(engine, reqs, prev):
        return False
    spec.chosen = spec.choose_shape(len(reqs))  # (a choice made before and not taken yet: that one)
    shape = spec.chosen[1]
    same = shape is not None and (shape == prev.shape if prev is not None else spec.policy.drafted_last)
    return same and _fits(engine, reqs, shape, prev)


def _eligible(engine, reqs: list[Request], prev: "Chained | None") -> bool:
    d, g = engine.drafter, engine.runner.graph_runner
    if g is None or d is None or not d.chains or not engine.overlap.applies() or not reqs:
        return False
    if type(engine.sampler) is not Sampler or type(engine.spec) is not SpecWorker:
        return False
    if not any(r.drafting for r in reqs):  # (then the ordinary step: a plain decode's)
        return False
    joining = [r for r in reqs if prev is not None and r.drafting and r.rid not in prev.live]
    if joining and (
        len(prev.reqs) + len(joining) > len(spec_future(g).lens) or not all(d.joins(r.rid) for r in joining)
    ):
        return False  # (one the drafter cannot join to the chain, or no spare row of the futures: the chain ends)
    # (greedy or sampled, seeded or not, logprobs or not, penalties and min_tokens or not: the graph applies them)
    return all(r.matcher is None and not r.reference for r in reqs)


def _fits(engine, reqs: list[Request], shape: TreeShape, prev: "Chained | None") -> bool:
    g, bases = engine.runner.graph_runner, [len(r.slots) for r in reqs]
    if verify_bucket(g, len(reqs), shape.num_draft_tokens, bases, shape.depth + 1) is None:
        return False
    return engine.drafter.chain_fits([r.rid for r in reqs if r.drafting], shape, prev is not None)


@dataclass
class Chained:
    """A chained spec step issued to the device, its result not read yet."""

    reqs: list[Request]
    nodes: int  # N: each tree's nodes
    tree_slots: torch.Tensor  # [b * N] int64 host ids, tree after tree (none joined a request yet)
    result: HostCopy  # [b, 2W + 1]: per request its path nodes [W], tokens [W], faulty-drafter flag; with `top`,
    # W * (1 + 2K) more: its path's logprobs (spec_graphs.path_logprobs_of)
    live: dict[int, int]  # rid -> row: the requests whose result is read (a request that ended since: dropped)
    shape: TreeShape  # the step's tree shape (a chain's steps share it)
    plain: set[int]  # the rids of its root-only rows (requests that do not draft)
    option: int | None  # the adaptive policy's option for the step (None: no policy)
    since: float  # when the step's seconds start: the read of the step before it in the chain, else its launch
    top: int | None = None  # K: the widest top_logprobs its requests ask for (None: none asks for logprobs)
    pairs: dict[int, int] = field(default_factory=dict)  # rid -> the rows its read predecessor's path committed


def spec_step(engine, reqs: list[Request]) -> list[StepEvent] | None:
    """A chained spec step read at once (a chain's only step: an arrival's, or the loop's last); None: the drafter
    failed to propose (its requests fall back; the caller runs the ordinary step)."""
    step = launch(engine, reqs)
    return None if step is None else finish(engine, step)


def launch(engine, reqs: list[Request], prev: Chained | None = None) -> Chained | None:
    """Issue a chained step of `reqs` (prev: the chained step in flight, whose futures it reads; None: a chain's
    first, from the host's state): the drafter's graph, the verify's, the result's copy queued. A request that does
    not draft (its drafter failed) rides as a root-only row: its next token the target's argmax at the bonus token
    of its row in `prev` (or at its last token, with none there; a sampled request's coupled sample), no drafter
    state. A drafting request with no row in `prev` (an arrival's first decode step) joins the chain from a spare row
    of the futures (Drafter.join_chained, module docstring)."""
    since = time.perf_counter()
    d, g, kv = engine.drafter, engine.runner.graph_runner, engine.kv_manager
    option, shape = engine.spec.choose_shape(len(reqs))  # (with the policy: chain_next's choice)
    stream = g.stream
    if d.stream is not stream:
        d.use_stream(stream)
    drafting = [r for r in reqs if r.drafting]
    inputs = [r.draft_input(_searched(r.params)) for r in drafting]
    fut = spec_future(g)
    rows = None if prev is None else [prev.live.get(r.rid, -1) for r in reqs]
    joined = {}  # rid -> its row of the futures, for a request that joins the chain (rows past prev's: spare)
    try:
        if prev is None:
            trees = d.propose(inputs, shape)
        else:
            joining = [(x, r) for x, r in zip(inputs, drafting) if r.rid not in prev.live]
            joined = {r.rid: len(prev.reqs) + i for i, (_, r) in enumerate(joining)}
            real = d.join_chained([x for x, _ in joining], fut, list(joined.values())) if joining else 0
            trees = d.propose_chained(inputs, shape, fut, [prev.live.get(r.rid, joined.get(r.rid)) for r in drafting])
    except Exception as e:  # noqa: BLE001 - a drafter fault sends its requests back to vanilla decoding
        if prev is not None:
            raise  # (the futures' step is in flight: the engine starts again from a clean state)
        engine.spec.fallback(drafting, type(e).__name__)
        return None
    packed = trees[0].batch
    if packed is None or not packed.holds(trees):
        raise RuntimeError("a chained spec step's search gave no packed trees")
    mixed = None
    if len(drafting) < len(reqs):  # (src: each row's tree, -1 root-only; roots: a root-only row's from the host)
        trees_at = iter(range(len(drafting)))
        src = [next(trees_at) if r.drafting else -1 for r in reqs]
        chained = rows or [-1] * len(reqs)
        mixed = (src, [-1 if r.drafting or p >= 0 else r.output_ids[-1] for r, p in zip(reqs, chained)])
    n = packed.longs.shape[2]
    top = top_bucket([r.params.logprobs for r in reqs if r.params.logprobs is not None])
    slots = kv.alloc(len(reqs) * n)
    try:
        keys, prefixes = [r.rid for r in reqs], [r.slots for r in reqs]
        rules = engine.sampler.graph_sampling(reqs), [engine.sampler.penalty_row(r) for r in reqs]
        captured, result = verify_spec(
            g, packed, trees[0].finite, slots, prefixes, keys, rows, shape.depth + 1, kv.pool, mixed, top, *rules
        )
        if kv.hidden is not None:  # (the captured layers beside the prefix cache, after the graph)
            stream.launch(kv.store_hidden, [slots], captured)
        copy = stream.to_host(result)  # the step's one device-to-host copy
    except BaseException:
        kv.free(slots)
        raise
    live, plain = {r.rid: i for i, r in enumerate(reqs)}, {r.rid for r in reqs if not r.drafting}
    step = Chained(reqs, n, slots, copy, live, shape, plain, option, since, top)
    for r in drafting:  # (a joining request's commit rows are known now: the host wrote them)
        if r.rid in joined:
            d.commit_chained(r.rid, real, r.slots[len(r.slots) :])
            step.pairs[r.rid] = real
    return step


def _searched(params: SamplingParams) -> SamplingParams:
    """What the drafter's search of a chained step sees of a request's parameters: a sampled request's as greedy's, so
    that a chain (topk 1) is the draft's argmax chain as for a greedy request, not a chain drawn from the draft's q
    (whose q only speculative sampling reads): the chained verify is coupled, for which a deterministic tree is the
    proposal (verify.py: the chance some child passes is the sum of p over the children)."""
    return params if params.greedy else replace(params, temperature=0.0)


def top_bucket(asked: list[int]) -> int | None:
    """K for a chained verify: the widest top_logprobs its requests ask, rounded up to 0, 1, 2, 4, ... (at most
    MAX_TOP_LOGPROBS; a graph per K, each request takes its own k of the K likeliest); None where none asks."""
    if not asked:
        return None
    k = max(asked)
    return min(1 << (k - 1).bit_length(), MAX_TOP_LOGPROBS) if k else 0


def finish(engine, step: Chained, following: Chained | None = None) -> list[StepEvent]:
    """Read a chained step's result and catch its live requests up (module docstring); following: the chained step
    issued after it, whose surplus work for a request this step ends is dropped (`drop`)."""
    rows = step.result.wait()
    n, w = step.nodes, min(step.nodes, WIDTH)  # (the verify's path columns)
    live = [(i, r) for i, r in enumerate(step.reqs) if r.rid in step.live]
    paths = {i: [x for x in rows[i][:w] if x >= 0] for i, _ in live}
    keep_at = [i * n + x for i, _ in live for x in paths[i]]
    drop_at = [i * n + x for i, _ in live for x in range(n) if x not in paths[i]]
    slots = step.tree_slots
    kept = slots[torch.tensor(keep_at, dtype=torch.long)].split([len(paths[i]) for i, _ in live])
    if drop_at:
        engine.kv_manager.free(slots[torch.tensor(drop_at, dtype=torch.long)])
    for (_, r), s in zip(live, grow([r.slots for _, r in live], list(kept))):
        r.slots = s
    d, g = engine.drafter, engine.runner.graph_runner
    feats = None if following is not None else spec_future(g).feats[: len(step.reqs), :w].clone()
    events = []
    for (i, r), s in zip(live, kept):
        k, drafted = len(paths[i]), 0 if r.rid in step.plain else n - 1
        res = VerifyResult(paths[i], rows[i][w : w + k], bool(rows[i][2 * w]))
        if r.params.logprobs is not None:
            res.logprobs = path_logprobs_of(rows[i], w, step.top, res.tokens, r.params.logprobs)
        SpecWorker._record(r, res, drafted)
        try:
            new = engine.sampler.append(r, res.tokens)
            lps = engine.sampler.logprobs(r, None, [], new, res.logprobs)
            events.append(StepEvent(r, new, res.num_accepted, drafted, lps))
        except RequestFault as f:
            events.append(fail(r, f))
        if res.draft_invalid:
            d.drop_chained(r.rid)  # (its draft state of the step after, if any, goes first)
            engine.spec.fallback([r], "invalid_draft")
        if r.finished:  # (its release drops it from the step after: Engine._release, OverlappedLoop.drop)
            continue
        if not r.drafting and r.rid not in step.plain:  # (a faulty drafter's request: it decodes without it from
            if following is not None:  # here on, its drafted tree in the step after dropped unread)
                drop(engine, following, r)
            continue
        if following is not None:
            g._table.account(r.rid, len(r.slots) + 1)  # (that step's verify wrote this path and its own root)
            if r.rid in step.plain:
                continue
            d.commit_chained(r.rid, k, s)  # its pairs of the step after: the first k were real
            following.pairs[r.rid] = k
        elif r.rid not in step.plain:  # the chain ends here: the path's features as an ordinary commit
            h = g.model.cfg.hidden_size
            hidden = {l: feats[i, :k, j * h : (j + 1) * h] for j, l in enumerate(g.capture_layers)}
            positions = to_device(torch.arange(len(r.slots) - k, len(r.slots)), g.model.device)
            cap = TargetCapture(r.token_ids[-k - 1 : -1], positions, s, hidden, engine.kv)
            engine.spec.call(lambda rid=r.rid, cap=cap: d.commit(rid, cap), [r])
    _observe(engine, step, following, [r for _, r in live], events)
    return events


def _observe(engine, step: Chained, following: Chained | None, live: list[Request], events: list[StepEvent]) -> None:
    """The policy learns what the step gave: its live requests' tokens, its rows, and as its seconds the host's time
    since the read of the step before it in the chain (its launch for a chain's first): a chained step's cost in
    the steady state of a chain, the next step's launch included and the device's work overlapping the host's. Its
    drafting seconds: the option's per request from its ordinary steps (the drafter does the same work in a chained
    step, inside a graph; the host's share of it overlaps), at most half the step's. Its rows: the trees' (a
    root-only row's one), as the ordinary step counts them."""
    now = time.perf_counter()
    if following is not None:
        following.since = now
    if step.option is None or not live:
        return
    seconds, h = now - step.since, engine.spec.policy.history[step.option]
    drafting = sum(r.rid not in step.plain for r in live)
    draft = min(h.draft_seconds * drafting if h.steps else 0.0, seconds / 2)
    rows = drafting * step.nodes + len(live) - drafting
    engine.spec.observe(step.option, len(live), seconds, events, rows, draft)


def clear(engine, step: Chained) -> None:
    """After a step fault: the step's trees' slots go back (its requests are released by the engine)."""
    for rid, i in step.live.items():
        engine.kv_manager.free(step.tree_slots[i * step.nodes : (i + 1) * step.nodes])
        engine.drafter.drop_chained(rid)  # (its draft state of the step: the requests' own is released with them)
    step.live.clear()


def drop(engine, step: Chained, r: Request) -> None:
    """r ended before the chained `step` is read: its result there is never read, its tree's slots go back, and
    so do its draft pairs there (those its read predecessor committed included)."""
    i = step.live.pop(r.rid, None)
    if i is None:
        return
    engine.kv_manager.free(step.tree_slots[i * step.nodes : (i + 1) * step.nodes])
    d = engine.drafter
    if r.rid in d.reqs:
        d.drop_chained(r.rid, step.pairs.pop(r.rid, 0))


Launched = Chained  # (the overlapped loop's name for a step in flight)
