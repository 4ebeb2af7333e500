"""Sampled requests in the overlapped loop's chained drafted steps (serving/spec_step.py): a request with a temperature
(top_k / top_p or not, seeded or not, logprobs or not; no penalties, grammar or min_tokens) rides the chains beside
greedy ones. The chained verify's graph takes each sampled row's token as its coupled sample (sampling.coupled_tokens:
Gumbel-max with the (seed, position) noise, the same as the ordinary step's verify.coupled_path), so a seeded request's
output is plain seeded decoding's whichever steps made it, and every greedy request's is vanilla's.

On the CPU the device is `helpers.QueuedStream`, as in test_engine_spec_overlap.py. Per drafter (EAGLE-3 and MoA, the
shipped heads, on the tree of those tests; EAGLE-3 on a chain too, where the chained search drafts the argmax chain
that coupled verification takes, the ordinary step sampled chains), three seeded sampled requests (top_p, top_k, a
plain temperature with logprobs) and a greedy one, shorter, run: without a drafter (plain decoding), in the loop
without overlap (the ordinary drafted step) and in the overlapped loop (with EAGLE-3 under the adaptive policy too).
The law of unseeded chained sampling is tests/sglang_ext/test_distribution.py's
(test_chained_unseeded_sampling_matches_target). The `gpu` case runs the scenario on CUDA's stream with captured
graphs.
"""

from __future__ import annotations

import pytest
from helpers import QueuedStream, drafter_pools_whole, slots_whole
from test_engine_spec_overlap import _order, _recorded, scripted_policy
from test_engine_spec_overlap_logprobs import TOL, _same_logprobs

from serving.config import EngineConfig
from serving.engine import Engine
from serving.spec_step import spec_chains
from sglang_ext.drafters import make_drafter
from sglang_ext.grammar import GrammarSpec
from sglang_ext.models.graph_runner import GraphRunner
from sglang_ext.sampling import SamplingParams
from sglang_ext.tree import TreeShape

TREE, CHAIN = TreeShape(3, 2, 6), TreeShape.chain(3)
REQUESTS = [  # (prompt, params): GREEDY the shortest, so that the sampled ones go on alone in the chains
    ("Write a haiku about rivers.", SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=11)),
    ("List four fruits.", SamplingParams(max_new_tokens=20, temperature=1.0, top_k=50, seed=12)),
    ("Tell me a story.", SamplingParams(max_new_tokens=24, temperature=0.7, seed=13, logprobs=2)),
    ("Count from one to twenty in words.", SamplingParams(max_new_tokens=10)),
]
GREEDY = 3


def _engine(target, overlap: bool, drafter: str | None, tree: TreeShape, stream=None) -> Engine:
    """As test_engine_spec_overlap._engine, at `tree` (drafter None: plain decoding, its decode steps the graphs')."""
    config = EngineConfig(overlap=overlap, prefill="separate", kv_slots=2048, tree=tree, adaptive=False)
    eng = Engine(target, make_drafter(drafter, target) if drafter else None, config)
    if eng.runner.graph_runner is None:
        eng.runner.graph_runner = GraphRunner(eng.model, eng.capture_layers, stream=stream)
        if eng.drafter is not None:
            eng.drafter.step_graphs = True
    return eng


def _run(target, overlap: bool, drafter: str | None, tree: TreeShape, stream=None):
    return drive(_engine(target, overlap, drafter, tree, stream), target, REQUESTS)


def drive(eng, target, requests, after_step=None):
    """requests [(text, params)] through eng.step until it has no work (at most 80 steps); after_step(step, reqs) after
    each step (an arrival, an abort). -> (eng, its requests): every slot back, the drafter's pools whole."""
    encode = lambda text: target.encode_chat([{"role": "user", "content": text}])  # noqa: E731
    reqs = [eng.add_request(encode(t), p) for t, p in requests]
    for step in range(80):
        if not eng.has_work:
            break
        eng.step()
        if after_step is not None:
            after_step(step + 1, reqs)
    assert not eng.has_work
    assert slots_whole(eng) and (eng.drafter is None or drafter_pools_whole(eng.drafter))
    return eng, reqs


@pytest.fixture(scope="module")
def vanilla(smollm2_fp32):
    """Plain decoding (no drafter): the seeded requests' seeded decoding, the greedy one's argmax."""
    return _run(smollm2_fp32, False, None, TREE)[1]


CASES = [("eagle3", TREE), ("moa", TREE), ("eagle3", CHAIN)]


@pytest.fixture(scope="module", params=CASES, ids=["eagle3-tree", "moa-tree", "eagle3-chain"])
def runs(smollm2_fp32, request):
    """Per drafter and tree: the loop without overlap, and the overlapped loop on a stand-in stream (its launches
    recorded)."""
    drafter, tree = request.param
    plain = _run(smollm2_fp32, False, drafter, tree)
    stream, seen = QueuedStream(), {}
    try:
        with _recorded(seen):
            eng, reqs = _run(smollm2_fp32, True, drafter, tree, stream)
    finally:
        stream.close()
    return {"plain": plain, "overlap": (eng, reqs, stream, seen)}


def test_sampled_requests_ride_the_chains(runs):
    """Every drafted step a chained one with one copy; step N+1 issued before step N is read, both while the sampled
    requests share the chains with the greedy one and once they are alone in them."""
    eng, reqs, stream, seen = runs["overlap"]
    assert stream.copies == eng.runner.graph_runner.runs > 0
    ahead, _ = _order(stream)
    rids = [set(r) for _, r in seen["launches"]]  # (copy i is launch i - 1's: its drafting requests)
    sampled, greedy = {r.rid for r in reqs[:GREEDY]}, reqs[GREEDY].rid
    mixed = [i for i in ahead if greedy in rids[i - 1] and rids[i - 1] & sampled]
    alone = [i for i in ahead if rids[i - 1] and rids[i - 1] <= sampled]
    assert len(mixed) >= 2 and len(alone) >= 2, (ahead, rids)
    assert all(r.stats.accepted_tokens > 0 for r in reqs)  # (drafts were accepted: multi-token steps)


def test_seeded_chained_outputs_equal_the_ordinary_step_and_plain_decoding(runs, vanilla):
    """Token for token and finish reasons: the overlapped loop's as the loop without overlap's and as plain decoding's
    (seeded decoding for the sampled requests, vanilla greedy for the greedy one); the logprobs request's logprobs as
    the ordinary step's (the target's raw ones)."""
    (_, plain), (_, reqs, *_) = runs["plain"], runs["overlap"]
    ends = lambda rs: [(r.output_ids, r.finish_reason) for r in rs]  # noqa: E731
    assert ends(reqs) == ends(plain) == ends(vanilla)
    lp, want = reqs[2], plain[2]
    assert len(lp.output_logprobs) == len(lp.output_ids) and [x.token for x in lp.output_logprobs] == lp.output_ids
    _same_logprobs(lp.output_logprobs, want.output_logprobs, TOL)


def test_what_rides_the_chains(smollm2_fp32):
    """spec_chains: sampled requests, seeded or not, with logprobs or not, alone or beside greedy ones, with penalties
    or min_tokens (the graph applies them: test_engine_overlap_penalties.py); not one with a grammar (its mask is
    the host's)."""
    stream = QueuedStream()
    try:
        eng = _engine(smollm2_fp32, True, "eagle3", TREE, stream)
        add = lambda **kw: eng.add_request([1, 9690, 30], SamplingParams(max_new_tokens=4, **kw))  # noqa: E731
        greedy, seeded = add(), add(temperature=0.8, seed=1, logprobs=2)
        unseeded, filtered = add(temperature=1.2), add(temperature=0.5, top_k=3, top_p=0.5)
        penalized, early = add(temperature=0.8, repetition_penalty=1.2), add(temperature=0.8, min_tokens=3)
        grammar = add(grammar=GrammarSpec("regex", "[ab]+"))
        eng.step()  # (their prefills)
        assert spec_chains(eng, [seeded]) and spec_chains(eng, [greedy, seeded, unseeded, filtered])
        assert spec_chains(eng, [greedy, penalized]) and spec_chains(eng, [seeded, early])
        assert grammar.matcher is not None and not spec_chains(eng, [greedy, grammar])
    finally:
        stream.close()


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["eagle3", "moa"])
def test_gpu_seeded_chained_outputs_equal_the_plain_loop(smollm2_cuda, drafter):
    """On CUDA (bf16, graphs captured): the scenario's tokens as the loop without overlap's; every verify a chained
    spec step with one copy."""
    plain = _run(smollm2_cuda, False, drafter, TREE)[1]
    eng, reqs = _run(smollm2_cuda, True, drafter, TREE)
    g = eng.runner.graph_runner
    assert g.graphs and eng.runner.stream.copies == g.runs > 0
    assert [(r.output_ids, r.finish_reason) for r in reqs] == [(r.output_ids, r.finish_reason) for r in plain]


def test_under_the_policy_seeded_chained_outputs_are_plain_decodings(smollm2_fp32, vanilla):
    """Under the adaptive policy (scripted: off and the smaller tree between the configured tree's steps, so chains
    start, end and restart; EAGLE-3), the overlapped loop's outputs are plain decoding's and chained steps ran."""
    stream = QueuedStream()
    with scripted_policy(stream):
        eng, reqs = _run(smollm2_fp32, True, "eagle3", TREE, stream)
    assert [(r.output_ids, r.finish_reason) for r in reqs] == [(r.output_ids, r.finish_reason) for r in vanilla]
    assert sum(c for c, _ in eng.policy.kinds) >= 2 and {o for o, *_ in eng.policy.seen} == {0, 1, 2}
