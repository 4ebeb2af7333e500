"""Arrivals while a chain is in flight (serving/decode_step.py: the overlapped loop): the arrivals' prefill forward
is issued before the step in flight is read, the running requests keep chaining, and each new request joins the
chain after its prefill (a plain decode row; a drafting row once its drafter settled its prompt: Drafter.settle,
join_chained). Every request's output is the loop without overlap's, and no slot of any pool leaks.

On the CPU the device is `helpers.QueuedStream` (work queued and run in order only once the host waits), as in
test_engine_overlap.py and test_engine_spec_overlap.py. The real SmolLM2 target (fp32), with no drafter (plain
decode steps), the shipped EAGLE-3 head and the shipped MoA head (trees), runs running requests that end every way
(max_tokens, EOS, a stop id, an abort) while requests arrive mid-chain: one alone, three at once (a seeded sampled one
among them: in plain decode steps its tokens drawn in the decode graph), a long prompt prefilled in chunks over
several steps, a prompt that hits the prefix cache (a running request's prompt), a running request aborted as requests
arrive, and an arrival aborted while its first chained steps are in flight.
"""

from __future__ import annotations

import pytest
from helpers import (
    QueuedStream,
    drafter_pools_whole,
    prefill_copies,
    prefills_in_flight,
    slots_whole,
    step_order,
)

import serving.spec_step as spec_mod
from serving.config import EngineConfig
from serving.engine import Engine
from sglang_ext.drafters import make_drafter
from sglang_ext.models.graph_runner import GraphRunner
from sglang_ext.sampling import SamplingParams
from sglang_ext.tree import TreeShape

PERIOD = 30  # SmolLM2's "." (a stop id)
TREE = TreeShape(3, 2, 6)
PREFILL_TOKENS = 32  # prompt tokens a step prefills at most: LONG's prompt takes three steps
RUNNING = [  # (prompt, params): ends by its length, by EOS, by a stop id, aborted (ABORT_RUNNING) before its length
    ("Name three rivers.", SamplingParams(max_new_tokens=9)),
    ("Hi!", SamplingParams(max_new_tokens=16)),
    ("Say OK.", SamplingParams(max_new_tokens=16, stop_token_ids=[PERIOD])),
    ("Count from one to twenty in words.", SamplingParams(max_new_tokens=48)),
]
SEEDED = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.95, seed=7)
LONG = (
    "Here are some notes about rivers. The Nile flows north through eleven countries and ends in a delta on the "
    "Mediterranean. The Amazon carries more water than any other river. The Danube passes four capital cities. "
    "The Mississippi drains much of North America. Which of these rivers passes four capitals?"
)
ARRIVALS = {  # engine step after which they arrive (5: see ABORT_RUNNING) -> (prompt, params); "seeded": SEEDED
    3: [("Tell me about the moon.", SamplingParams(max_new_tokens=30))],
    5: [
        ("What is 2+2?", SamplingParams(max_new_tokens=6)),
        ("Write a haiku about rain.", "seeded"),
        ("Name a color.", SamplingParams(max_new_tokens=5, stop_token_ids=[PERIOD])),
    ],
    7: [(LONG, SamplingParams(max_new_tokens=10))],
    9: [(RUNNING[3][0], SamplingParams(max_new_tokens=7))],  # (RUNNING[3]'s prompt: a prefix cache hit)
}
# RUNNING[3] is aborted as the "5" arrivals come, once it has ABORT_RUNNING tokens; the first arrival once it has
# ABORT_ARRIVAL tokens (by tokens, not steps: a request that joins the overlapped loop's chain is read one Engine.step
# later than without overlap, so a step count falls on other tokens)
ABORT_RUNNING, ABORT_ARRIVAL = 4, 4


def _engine(target, overlap: bool, drafter: str | None, stream=None) -> Engine:
    """prefill "separate": every decode step of both loops replays the graphs (the CPU's eager mixed forward rounds
    differently from them)."""
    config = EngineConfig(
        overlap=overlap, prefill="separate", kv_slots=2048, tree=TREE, adaptive=False, prefill_tokens=PREFILL_TOKENS
    )
    eng = Engine(target, make_drafter(drafter, target) if drafter else None, config)
    if eng.runner.graph_runner is None:  # (the CPU: the graph runner's static path run eagerly)
        eng.runner.graph_runner = GraphRunner(eng.model, eng.capture_layers, stream=stream)
        if eng.drafter is not None:
            eng.drafter.step_graphs = True
    return eng


def _scenario(target, overlap: bool, drafter: str | None, stream=None):
    """RUNNING, then ARRIVALS and the aborts, through Engine.step -> (the engine, its requests (RUNNING's, then the
    arrivals' in order), per step (the ids whose first token it gave, the ids of running requests it ended))."""
    eng = _engine(target, overlap, drafter, stream)
    encode = lambda text: target.encode_chat([{"role": "user", "content": text}])  # noqa: E731
    reqs = [eng.add_request(encode(t), p) for t, p in RUNNING]
    arrived, steps, log, done = [], 0, [], set()
    while eng.has_work:
        was_running = {r.rid for r in eng.running}
        events = eng.step()
        steps += 1
        firsts = {e.request.rid for e in events if e.request.rid not in was_running}
        ended = {e.request.rid for e in events if e.request.rid in was_running and e.request.finished}
        log.append((firsts, ended))
        due = [s for s in ARRIVALS if s <= steps and s not in done]
        if 5 not in done and not reqs[3].finished and len(reqs[3].output_ids) >= ABORT_RUNNING:
            due = sorted({*due, 5})
        elif 5 in due:
            due.remove(5)
        for s in due:
            done.add(s)
            for text, params in ARRIVALS[s]:
                params = SEEDED if params == "seeded" else params
                arrived.append(eng.add_request(encode(text), params))
            if s == 5:
                eng.abort(reqs[3])
        if arrived and not arrived[0].finished and len(arrived[0].output_ids) >= ABORT_ARRIVAL:
            eng.abort(arrived[0])
        assert steps < 120
    return eng, reqs + arrived, log


class InOrderStream(QueuedStream):
    """The stand-in stream with each job run as it is issued: the device's order is the host's issue order, as on
    CUDA's one stream (test_outputs_equal_the_loop_without_overlap: what the queued stand-in cannot model)."""

    def _put(self, job) -> int:
        n = super()._put(job)
        self._wait(n)
        return n


@pytest.fixture(scope="module", params=[None, "eagle3", "moa"], ids=["plain", "eagle3", "moa"])
def runs(smollm2_fp32, request):
    """Per drafter (None: plain decode steps), the scenario without overlap (on the synchronous stream: the ordinary
    step's eager ops would run ahead of the stand-in's queued work) and with it (a stand-in stream, spec_step.launch
    recorded: per chained step issued, whether it continued a chain, its drafting ids, the ids that joined it); for
    MoA with it on InOrderStream too ("in_order")."""
    drafter, out = request.param, {}
    for name in ("plain", "overlap", "in_order")[: 2 + (drafter == "moa")]:
        stream = InOrderStream() if name == "in_order" else QueuedStream() if name == "overlap" else None
        launches, real = [], spec_mod.launch

        def launch(engine, reqs, prev=None, real=real, launches=launches):
            step = real(engine, reqs, prev)
            if step is not None:
                drafted = {r.rid for r in reqs if r.rid not in step.plain}
                joined = {rid for rid in drafted if prev is not None and rid not in prev.live}
                launches.append((prev is not None, drafted, joined))
            return step

        spec_mod.launch = launch
        try:
            eng, reqs, log = _scenario(smollm2_fp32, name == "overlap", drafter, stream)
        finally:
            spec_mod.launch = real
            if stream is not None:
                stream.close()
        out[name] = (eng, reqs, log, stream, launches)
    return out


def _summary(eng: Engine, reqs) -> list:
    assert slots_whole(eng), "KV slots leaked"
    assert eng.drafter is None or drafter_pools_whole(eng.drafter), "drafter slots leaked"
    stats = [(r.stats.verify_steps, r.stats.draft_tokens, r.stats.accepted_tokens) for r in reqs]
    kept = [] if eng.drafter is None else [len(eng.drafter.kept)]
    return [(r.output_ids, r.finish_reason) for r in reqs] + stats + [eng.prefix_cache.tokens] + kept


def test_the_scenario_covers_every_arrival_pattern(runs):
    """Without overlap: requests end every way; the long prompt took several prefill steps; the last arrival hit the
    prefix cache; both aborts fell on requests that were decoding."""
    _, reqs, log, *_ = runs["plain"]
    arrivals = reqs[len(RUNNING) :]
    assert [r.finish_reason for r in reqs[:4]] == ["length", "stop", "stop", "abort"]
    assert arrivals[0].finish_reason == "abort" and ABORT_ARRIVAL <= len(arrivals[0].output_ids) < 30
    assert all(r.finish_reason in ("length", "stop") for r in arrivals[1:])
    assert len(arrivals[-2].prompt_ids) > 2 * PREFILL_TOKENS and arrivals[-1].cached_tokens > 0  # (chunks; a hit)
    assert ABORT_RUNNING <= len(reqs[3].output_ids) < 48


def test_outputs_equal_the_loop_without_overlap(runs):
    """Token for token (the seeded sampled arrival's too), finish reasons, verify steps, drafts and acceptance, the
    prefix cache's tokens, what the drafter keeps beside it; no slot of the target's or the drafter's pools leaked.
    MoA on the queued stand-in: tokens, finish reasons and pools; in the device's order (InOrderStream), everything
    (when a batch's bucket grows mid-chain, MoA's search runner starts its slot tables over while the step before is
    queued; that step's commit, a function the stand-in runs again at its turn, looks its tables up then and writes
    the new ones, where a captured graph writes those it was captured with: the requests' drafts differ on the queued
    stand-in, never their tokens)."""
    plain, overlap = _summary(*runs["plain"][:2]), _summary(*runs["overlap"][:2])
    if "in_order" in runs:
        assert _summary(*runs["in_order"][:2]) == plain
        n = len(runs["plain"][1])
        plain, overlap = plain[:n], overlap[:n]
    assert overlap == plain


def test_arrivals_prefill_before_the_step_in_flight_is_read(runs):
    """Every arrivals' prefill (a chunk of the long prompt included) was launched while a step was in flight, before
    that step was read; no step of the chain was read before the next one was issued (arrivals end no chain); a
    step's arrivals' first tokens and its own running requests' ends came in the same Engine.step."""
    eng, reqs, log, stream, _ = runs["overlap"]
    launched = prefills_in_flight(stream.log)
    beside = [step for step, read in launched if step is not None]  # (the others: beside a chain's first step)
    assert len(beside) >= len(ARRIVALS) + 1 and all(not read for _, read in launched), launched  # (LONG: chunks)
    ahead, behind = step_order(stream.log)
    assert behind == [] and len(ahead) >= 8, (ahead, behind)
    assert any(firsts and ended for firsts, ended in log), log  # (a prefill beside a step that ended requests)


def test_arrivals_join_the_chains(runs):
    """Each arrival that decodes for a while joins the chain its prefill ran beside: a drafter's drafts in a chained
    step, joined from the futures (the step it joined continued the chain)."""
    eng, reqs, _, _, launches = runs["overlap"]
    if eng.drafter is None:
        return
    joined = set().union(*(j for _, _, j in launches))
    late = [r.rid for r in reqs[len(RUNNING) :] if r.stats.verify_steps >= 3]
    assert late and set(late) <= joined, (late, launches)
    assert all(chained for chained, _, j in launches if j)


def test_one_device_to_host_copy_per_step(runs):
    """A copy per step (a replayed decode or verify) and per arrivals' prefill that finished a prompt, each read once;
    only the last step's (surplus) is never read."""
    eng, _, _, stream, _ = runs["overlap"]
    prefills, reads = prefill_copies(stream.log), [i for kind, i in stream.log if kind == "read"]
    assert stream.copies == eng.runner.graph_runner.runs + len(prefills) and prefills
    assert sorted(reads) == list(range(1, stream.copies))


def _grown(target, overlap: bool, stream=None) -> list:
    """MoA, two requests in a chain (search bucket 2; rows 1 and 2 of the search's slot tables), the first ends (row 1
    free), then three arrive at once, LONG's prompt first, and join the chain (bucket 4): the search's held slots grow
    with the bucket, so its runner starts its slot tables over (SearchRunner.bind), where the rows go to the requests
    in another order (the running request's row 2 is LONG's there) -> per request its tokens, finish reason, verify
    steps, drafts and accepted drafts."""
    config = EngineConfig(overlap=overlap, prefill="separate", kv_slots=2048, tree=TREE, adaptive=False)
    eng = Engine(target, make_drafter("moa", target), config)
    eng.runner.graph_runner = GraphRunner(eng.model, eng.capture_layers, stream=stream)
    eng.drafter.step_graphs = True
    encode = lambda text: target.encode_chat([{"role": "user", "content": text}])  # noqa: E731
    first = [RUNNING[2], (RUNNING[0][0], SamplingParams(max_new_tokens=30))]  # (a stop id after a few tokens; longer)
    reqs = [eng.add_request(encode(t), p) for t, p in first]
    for _ in range(80):
        if not eng.has_work:
            break
        eng.step()
        if reqs[0].finished and len(reqs) == 2:  # (by the first's end: the same point in both loops)
            later = [LONG, "Tell me about the moon.", "Name a color."]
            reqs += [eng.add_request(encode(t), SamplingParams(max_new_tokens=10)) for t in later]
    assert len(reqs) == 5 and not eng.has_work and slots_whole(eng) and drafter_pools_whole(eng.drafter)
    return [
        (r.output_ids, r.finish_reason, r.stats.verify_steps, r.stats.draft_tokens, r.stats.accepted_tokens)
        for r in reqs
    ]


def test_moa_chain_whose_bucket_grows_drafts_as_the_loop_without_overlap(smollm2_fp32):
    """MoA's chained step binds its search runner to the grown bucket's pools before its commit counts the cells it
    appends (MoAGraphs._bind_search), so the commit appends to the tables the search then reads. In the device's order
    (InOrderStream), the requests' drafts and acceptance are the loop without overlap's. (With the commit's cells
    counted on the tables the search then drops, the running request's drafts differ: 14 verify steps and 15 accepted
    drafts where the loop without overlap takes 15 and 14.)"""
    plain = _grown(smollm2_fp32, False)
    stream, sizes, real = InOrderStream(), [], spec_mod.launch

    def launch(engine, reqs, prev=None):
        step = real(engine, reqs, prev)
        if step is not None:
            sizes.append((len(prev.reqs) if prev is not None else 0, len(reqs)))
        return step

    spec_mod.launch = launch
    try:
        overlap = _grown(smollm2_fp32, True, stream)
    finally:
        spec_mod.launch = real
        stream.close()
    assert (1, 4) in sizes and sizes.index((1, 4)) > sizes.index((2, 1)), sizes  # (2 -> 1 -> 4 in one chain)
    assert overlap == plain
