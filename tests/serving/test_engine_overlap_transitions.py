"""The overlapped loop leaving its chains (serving/decode_step.py, OverlappedLoop): every way a step goes back to the
engine's ordinary step, and back into a chain after, gives the outputs of the loop without overlap, and nothing the
loop issued is still queued when an ordinary step begins (OverlappedLoop.drain).

The ways out, in one scenario per drafter (None: plain decode steps; EAGLE-3): an arrival with a grammar (its prefill
needs the step in flight read first) and its decoding (its mask is the host's), an arrival with a predicted output
(with EAGLE-3 its decoding too), a batch larger than the graph buckets (here 1, 2, 4: an eager step), with an arrival
that rides beside the step in flight the step before the grammar's (EAGLE-3's settle of its prompt is issued after that
step's copy: reading the step waits for its copy only, so only the drain runs it before the ordinary step), and an
abort mid-chain (the chain goes on).

On the CPU the device is `helpers.QueuedStream`, its ordinary steps in order (test_engine_spec_overlap._in_order: on
CUDA their eager ops queue behind the work they issue; the stand-in runs eager ops at once, so without it every
ordinary step that replays a graph reads the graph's outputs before the replay ran and the outputs differ, with or
without overlap). That helper asserts the queue empty when an ordinary step begins: with OverlappedLoop.drain a no-op,
the EAGLE-3 case fails there (the settle's work queued), while the outputs still agree (the ordinary step's first
replay runs what was queued before it).
"""

from __future__ import annotations

import pytest
from helpers import QueuedStream
from test_engine_overlap_sampled import _ends
from test_engine_overlap_sampled import _recorded as _plain_recorded
from test_engine_spec_overlap import _in_order
from test_engine_spec_overlap import _recorded as _spec_recorded
from test_engine_spec_overlap_sampled import _engine, drive

from serving.engine import Engine
from sglang_ext.grammar import GrammarSpec
from sglang_ext.sampling import SamplingParams
from sglang_ext.tree import TreeShape

TREE, BUCKETS = TreeShape(3, 2, 6), (1, 2, 4)
REQUESTS = [  # (prompt, params)
    ("Name three rivers.", SamplingParams(max_new_tokens=22)),
    ("Write a haiku about rivers.", SamplingParams(max_new_tokens=22, temperature=0.9, top_p=0.95, seed=11)),
    ("Count from one to twenty in words.", SamplingParams(max_new_tokens=22)),
]
ABORTED, ABORT_AT = 1, 10  # aborted once it has this many tokens
SHORT = SamplingParams(max_new_tokens=3)
# (Engine.step after which they arrive (the first two: before any step count differs between the loops: reading the
# step in flight alone adds one), or -n: once the first request has n tokens) -> the arrivals
ARRIVALS = {
    2: [("Tell me a story.", SamplingParams(max_new_tokens=3, temperature=0.7, seed=5))],  # (rides beside)
    3: [("Answer a or b.", SamplingParams(max_new_tokens=4, grammar=GrammarSpec("regex", "[ab]+")))],
    -9: [("Say OK.", SamplingParams(max_new_tokens=6, prediction=[9690, 30, 2]))],
    -14: [("Hi!", SHORT), ("What is 7*8?", SHORT), ("Name a color.", SHORT), ("Name a fruit.", SHORT)],
}


def _why_ordinary(eng: Engine) -> set[str]:
    """Why a step now may leave the chain (before it runs): the reasons that hold, empty where it must chain."""
    running, waiting, drafted = eng.scheduler.running, list(eng.scheduler.waiting), eng.drafter is not None
    why = set()
    if not running:
        why.add("nothing running")
    if any(r.matcher is not None for r in running + waiting):
        why.add("grammar")
    if any(r.reference for r in waiting) or (drafted and any(r.reference for r in running)):
        why.add("prediction")
    if len(running) > BUCKETS[-1]:
        why.add("outside the buckets")
    return why


def _run(target, overlap: bool, drafter: str | None, stream=None):
    """The scenario through Engine.step -> (the engine, its requests, per step (whether a chained step was issued
    in it, the reasons it could leave the chain))."""
    eng = _engine(target, overlap, drafter, TREE, stream)
    eng.runner.graph_runner.batch_buckets = BUCKETS
    steps, real = [], eng.step
    launches = lambda: seen.get("launches", []) + plain  # noqa: E731

    def step():
        why, before = _why_ordinary(eng), [c for c, _ in launches()]
        events = real()
        steps.append((any(c for c, _ in launches()[len(before) :]), why))
        return events

    def after_step(step: int, reqs: list) -> None:
        for at in [n for n in ARRIVALS if n == step or (n < 0 and n not in arrived and len(reqs[0].output_ids) >= -n)]:
            arrived.add(at)
            for text, params in ARRIVALS[at]:
                reqs.append(eng.add_request(target.encode_chat([{"role": "user", "content": text}]), params))
        if len(reqs[ABORTED].output_ids) >= ABORT_AT and not reqs[ABORTED].finished:
            eng.abort(reqs[ABORTED])

    eng.step, seen, plain, arrived = step, {}, [], set()
    with _spec_recorded(seen), _plain_recorded(plain):
        eng, reqs = drive(eng, target, REQUESTS, after_step)
    return eng, reqs, steps


@pytest.fixture(scope="module", params=[None, "eagle3"], ids=["plain-decode", "eagle3"])
def runs(smollm2_fp32, request):
    """The scenario without overlap (the synchronous stream) and with it (the stand-in, its ordinary steps in
    order)."""
    plain = _run(smollm2_fp32, False, request.param)
    stream, real = QueuedStream(), Engine._run
    Engine._run = _in_order(stream, real)
    try:
        overlapped = _run(smollm2_fp32, True, request.param, stream)
    finally:
        Engine._run = real
        stream.close()
    return {"plain": plain, "overlap": overlapped}


def test_outputs_equal_the_plain_loop(runs):
    """Token for token, finish reasons, verify steps and (the seeded sampled requests') samples; requests end by
    their length and an abort mid-chain."""
    (_, plain, _), (_, reqs, _) = runs["plain"], runs["overlap"]
    assert _ends(reqs) == _ends(plain)
    assert [r.finish_reason for r in reqs].count("abort") == 1 and reqs[ABORTED].finish_reason == "abort"
    assert len(reqs) == len(REQUESTS) + sum(map(len, ARRIVALS.values()))


def test_every_step_that_can_chain_chains(runs):
    """A step issues no chained step only where the loop must leave the chain (a grammar, a predicted output, a batch
    outside the buckets, nothing running), each of those happened, and the chain came back after the last."""
    _, _, steps = runs["overlap"]
    unchained = [why for chained, why in steps if not chained]
    assert all(unchained), steps
    assert {"grammar", "prediction", "outside the buckets", "nothing running"} <= set().union(*unchained)
    assert sum(chained for chained, _ in steps[-3:]) >= 2, steps  # (the chain back after the last way out)
