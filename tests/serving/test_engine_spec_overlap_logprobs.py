"""Greedy requests that ask for logprobs in the overlapped loop's chained drafted steps (serving/spec_step.py): their
accepted tokens' logprobs and top alternatives are taken inside the chained verify's graph from its logits and come
up in the step's one device-to-host copy, so step N+1 is still issued before step N is read, and every token and
logprob is the loop without overlap's (its ordinary drafted step: verify.path_logprobs on its verify's logits).

On the CPU the device is `helpers.QueuedStream`, as in test_engine_spec_overlap.py. The batch mixes requests with
logprobs (top_logprobs 3, and 0: the chosen token's alone, narrower than the batch's widest) and one without; the
one with top_logprobs 0 decodes without its drafter (a fallback after its prefill), riding the chains as a root-only
row; the longest, with logprobs, ends alone in them. The `gpu` case runs the same scenario on CUDA's stream.
"""

from __future__ import annotations

import math

import pytest
from helpers import QueuedStream, drafter_pools_whole, prefill_copies, prefills_in_flight, slots_whole, step_order
from test_engine_spec_overlap import _engine, _order, _recorded

from serving import decode_step
from serving.spec_step import Chained, spec_chains
from sglang_ext.sampling import SamplingParams

# (prompt, params): the first and the third ask for logprobs; the first outlives the others; RIDER falls back
REQUESTS = [
    ("Count from one to twenty in words.", SamplingParams(max_new_tokens=28, logprobs=3)),
    ("Name three rivers.", SamplingParams(max_new_tokens=8)),
    ("Hi!", SamplingParams(max_new_tokens=8, logprobs=0)),
]
RIDER = 2
TOL = 1e-5  # fp32 on the CPU: both loops' logits come from the same static forward


def _run(target, overlap: bool, drafter: str, stream=None):
    eng = _engine(target, overlap, stream, drafter)
    encode = lambda text: target.encode_chat([{"role": "user", "content": text}])  # noqa: E731
    reqs = [eng.add_request(encode(t), p) for t, p in REQUESTS]
    eng.step()  # (the prefills)
    assert all(r.output_ids and r.drafting for r in reqs)
    eng.spec.fallback([reqs[RIDER]], "test")
    for _ in range(60):
        if not eng.has_work:
            break
        eng.step()
    assert not eng.has_work
    assert slots_whole(eng) and drafter_pools_whole(eng.drafter)
    return eng, reqs


@pytest.fixture(scope="module", params=["eagle3", "moa"])
def runs(smollm2_fp32, request):
    """Per drafter, the scenario without overlap, and with it on a stand-in stream (its launches recorded)."""
    plain = _run(smollm2_fp32, False, request.param)
    stream, seen = QueuedStream(), {}
    try:
        with _recorded(seen):
            eng, reqs = _run(smollm2_fp32, True, request.param, stream)
    finally:
        stream.close()
    return {"plain": plain, "overlap": (eng, reqs, stream, seen)}


def _same_logprobs(got, want, tol: float) -> None:
    """Token for token, each logprob within tol, the alternatives' ids in order and their logprobs within tol (two
    alternatives whose logprobs are within 2 tol of each other may come in either order)."""
    assert len(got) == len(want) > 0
    for a, b in zip(got, want):
        assert a.token == b.token and math.isclose(a.logprob, b.logprob, abs_tol=tol), (a, b)
        assert len(a.top) == len(b.top), (a, b)
        vals = [x for _, x in b.top]
        for i, ((t, x), (u, y)) in enumerate(zip(a.top, b.top)):
            tie = any(abs(y - v) <= 2 * tol for j, v in enumerate(vals) if abs(j - i) == 1)
            assert math.isclose(x, y, abs_tol=tol) and (t == u or tie), (i, a, b)


def test_logprobs_requests_ride_the_chains(runs):
    """Every drafted step a chained one with one copy, each read once (but the last, surplus); step N+1 issued
    before step N is read both while the batch mixes requests with and without logprobs (RIDER in it as a root-only
    row, its root on the device) and once the longest logprobs request is alone in it."""
    eng, reqs, stream, seen = runs["overlap"]
    assert stream.copies == eng.runner.graph_runner.runs > 0
    assert [i for kind, i in stream.log if kind == "read"] == list(range(1, stream.copies))
    ahead, _ = _order(stream)
    rids = [set(r) for _, r in seen["launches"]]  # (copy i is launch i - 1's: its drafting requests)
    first, other, rider = reqs[0].rid, reqs[1].rid, reqs[RIDER].rid
    mixed = [i for i in ahead if {first, other} <= rids[i - 1] and seen["rides"][i - 1].get(rider)]
    alone = [i for i in ahead if rids[i - 1] == {first} and not seen["rides"][i - 1]]
    assert len(mixed) >= 2 and len(alone) >= 2, (ahead, rids, seen["rides"])
    for n in ahead:  # (step N+1's two replays and its copy between step N's copy and its read)
        between = stream.log[stream.log.index(("copy", n)) + 1 : stream.log.index(("read", n))]
        assert between.count(("replay", None)) == 2 and ("copy", n + 1) in between
    assert isinstance(eng.overlap.inflight, Chained) and not eng.overlap.inflight.live


def test_chained_tokens_and_logprobs_equal_the_plain_loop(runs):
    """Token for token, finish reasons, drafts and acceptance as the plain loop; the logprobs requests' logprobs
    (one per output token: the chosen token's, its top_logprobs alternatives, likeliest first) as its too."""
    (plain_eng, plain), (eng, reqs, *_) = runs["plain"], runs["overlap"]
    summary = lambda rs: [(r.output_ids, r.finish_reason, r.stats.accepted_by_depth) for r in rs]  # noqa: E731
    assert summary(reqs) == summary(plain) and eng.prefix_cache.tokens == plain_eng.prefix_cache.tokens
    assert sum(r.stats.accepted_tokens for r in reqs) > 0
    for r, p in zip(reqs, plain):
        if r.params.logprobs is None:
            assert r.output_logprobs == [] == p.output_logprobs
            continue
        assert len(r.output_logprobs) == len(r.output_ids)
        assert all(len(lp.top) == r.params.logprobs for lp in r.output_logprobs)
        assert [lp.token for lp in r.output_logprobs] == r.output_ids
        _same_logprobs(r.output_logprobs, p.output_logprobs, TOL)


def test_a_greedy_logprobs_request_chains(smollm2_fp32):
    """spec_chains: a greedy request with logprobs chains, alone or beside one without, and a sampled one with logprobs
    too (test_engine_spec_overlap_sampled.py), and a penalized one (its logprobs the raw ones, as the ordinary step's:
    test_engine_overlap_penalties.py)."""
    stream = QueuedStream()
    try:
        eng = _engine(smollm2_fp32, True, stream)
        lp = eng.add_request([1, 9690, 30], SamplingParams(max_new_tokens=4, logprobs=5))
        greedy = eng.add_request([1, 9690, 30], SamplingParams(max_new_tokens=4))
        sampled = eng.add_request([1, 9690, 30], SamplingParams(max_new_tokens=4, temperature=0.8, seed=1, logprobs=2))
        penalized = eng.add_request([1, 9690, 30], SamplingParams(max_new_tokens=4, frequency_penalty=1.0, logprobs=1))
        eng.step()  # (their prefills)
        assert spec_chains(eng, [lp]) and spec_chains(eng, [lp, greedy]) and spec_chains(eng, [lp, sampled])
        assert spec_chains(eng, [lp, penalized])
    finally:
        stream.close()


ARRIVING = [  # (prompt, params): arrive while a chain runs, asking for logprobs (the first token's included)
    ("Name a color.", SamplingParams(max_new_tokens=8, logprobs=3)),
    ("Write a haiku about rain.", SamplingParams(max_new_tokens=8, temperature=0.8, seed=7, logprobs=0)),
]


def _arrivals(target, overlap: bool, stream=None, arriving=ARRIVING, drafter="eagle3", prefill_tokens=None):
    """`drafter` (None: plain decode steps): REQUESTS[0] (without its logprobs) decodes in a chain; after two steps
    `arriving` arrive (prompts prefilled prefill_tokens at a time; None: the engine's default) -> (the engine, the
    requests)."""
    eng = _engine(target, overlap, stream, drafter)
    eng.scheduler.prefill_tokens = prefill_tokens or eng.scheduler.prefill_tokens
    encode = lambda text: target.encode_chat([{"role": "user", "content": text}])  # noqa: E731
    reqs = [eng.add_request(encode(REQUESTS[0][0]), SamplingParams(max_new_tokens=28))]
    for step in range(60):
        if not eng.has_work:
            break
        eng.step()
        if step == 1:
            reqs += [eng.add_request(encode(t), p) for t, p in arriving]
    assert not eng.has_work and slots_whole(eng) and (drafter is None or drafter_pools_whole(eng.drafter))
    return eng, reqs


def test_arrivals_asking_for_logprobs_prefill_beside_the_step_in_flight(smollm2_fp32):
    """Arrivals that ask for logprobs (greedy, and seeded sampled with top_logprobs 0) are prefilled beside the step in
    flight, their first tokens' logprobs in the prefill's one copy, and join the chain: no step read before the next
    was issued; tokens and logprobs (one per output token, the first's included) are the loop without overlap's."""
    _, plain = _arrivals(smollm2_fp32, False)
    stream = QueuedStream()
    try:
        _, reqs = _arrivals(smollm2_fp32, True, stream)
    finally:
        stream.close()
    assert [read for _, read in prefills_in_flight(stream.log)] == [False]
    ahead, behind = step_order(stream.log)
    assert behind == [] and len(ahead) >= 8, (ahead, behind)
    assert [(r.output_ids, r.finish_reason) for r in reqs] == [(r.output_ids, r.finish_reason) for r in plain]
    for r, p in zip(reqs[1:], plain[1:]):
        assert [lp.token for lp in r.output_logprobs] == r.output_ids
        assert all(len(lp.top) == r.params.logprobs for lp in r.output_logprobs)
        _same_logprobs(r.output_logprobs, p.output_logprobs, TOL)


PROMPT_ASKING = [  # (prompt, params): arrive while a chain runs, asking for their prompt's logprobs
    ("Name a color.", SamplingParams(max_new_tokens=6, prompt_logprobs=2)),
    (
        "Write a haiku about rain.",
        SamplingParams(max_new_tokens=6, temperature=0.8, seed=7, logprobs=1, prompt_logprobs=0),
    ),
    ("Tell me about the moon.", SamplingParams(max_new_tokens=6)),
]
CHUNK = 16  # prompt tokens a step prefills at most: the first two prompts take two steps each


@pytest.mark.parametrize("drafter", [None, "eagle3"])
def test_arrivals_asking_for_prompt_logprobs_prefill_beside_the_step_in_flight(smollm2_fp32, drafter):
    """Arrivals that ask for their prompt's logprobs (top 2, and 0 beside output logprobs), beside one that does not,
    their prompts in chunks, are prefilled beside the step in flight (every chunk: no step read before the next was
    issued), each prefill with one copy and each step with one; prompt logprobs (one per prompt token after the
    first, within TOL), tokens and output logprobs are the loop without overlap's."""
    _, plain = _arrivals(smollm2_fp32, False, None, PROMPT_ASKING, drafter, CHUNK)
    stream = QueuedStream()
    try:
        eng, reqs = _arrivals(smollm2_fp32, True, stream, PROMPT_ASKING, drafter, CHUNK)
    finally:
        stream.close()
    assert all(len(r.prompt_ids) > CHUNK for r in reqs[1:3])  # (chunks)
    beside = [read for _, read in prefills_in_flight(stream.log)]
    assert len(beside) >= 3 and not any(beside), beside
    ahead, behind = step_order(stream.log)
    assert behind == [] and len(ahead) >= 8, (ahead, behind)
    prefills = prefill_copies(stream.log)
    assert len(prefills) == len(beside) and stream.copies - len(prefills) == eng.runner.graph_runner.runs
    assert [(r.output_ids, r.finish_reason) for r in reqs] == [(r.output_ids, r.finish_reason) for r in plain]
    for r, p in zip(reqs[1:], plain[1:]):
        if r.params.prompt_logprobs is None:
            assert r.prompt_logprobs == [] == p.prompt_logprobs
            continue
        assert [lp.token for lp in r.prompt_logprobs] == r.prompt_ids[1:]
        assert all(len(lp.top) == r.params.prompt_logprobs for lp in r.prompt_logprobs)
        _same_logprobs(r.prompt_logprobs, p.prompt_logprobs, TOL)
    _same_logprobs(reqs[2].output_logprobs, plain[2].output_logprobs, TOL)


@pytest.mark.parametrize("after", [0, 1], ids=["a-middle-chunk", "the-last-chunk"])
def test_a_prompt_logprobs_fault_beside_the_step_in_flight_fails_that_request_alone(smollm2_fp32, monkeypatch, after):
    """A fault while taking an arrival's prompt logprobs in a prefill beside the step in flight (a chunk in the middle
    of its prompt, or the one that ends it) fails that request alone, as the ordinary step does (finish_reason
    "error", stage "logprobs"): the chain runs on, the other requests' tokens and logprobs are those of a run without
    the fault, and every slot comes back."""
    _, plain = _arrivals(smollm2_fp32, False, None, PROMPT_ASKING, "eagle3", CHUNK)
    real, calls = decode_step.graph_path_logprobs, []

    def faulty(rows, at, path, top):  # (top 2: only PROMPT_ASKING[0]'s prompt logprobs ask for it)
        if top == 2:
            calls.append(path[0].tolist())
            if len(calls) > after:
                raise RuntimeError("injected fault in the prompt's logprobs")
        return real(rows, at, path, top)

    monkeypatch.setattr(decode_step, "graph_path_logprobs", faulty)
    stream = QueuedStream()
    try:
        eng, reqs = _arrivals(smollm2_fp32, True, stream, PROMPT_ASKING, "eagle3", CHUNK)
    finally:
        stream.close()
    assert len(calls) == after + 1  # (the faulty request's chunks stop at its fault)
    beside = [read for _, read in prefills_in_flight(stream.log)]
    assert beside and not any(beside), beside
    bad = reqs[1]
    assert (bad.finish_reason, bad.error, bad.output_ids) == ("error", "logprobs", [])
    # its prompt logprobs: those of the chunks before the faulty one (rows predicting prompt tokens 1..), none of it
    predicted, faulty = bad.prompt_ids[1:], calls[after]
    start = next(j for j in range(len(predicted)) if predicted[j : j + len(faulty)] == faulty)
    assert start > 0 and len(bad.prompt_logprobs) == start
    _same_logprobs(bad.prompt_logprobs, plain[1].prompt_logprobs[:start], TOL)
    for i in (0, 2, 3):
        assert (reqs[i].output_ids, reqs[i].finish_reason) == (plain[i].output_ids, plain[i].finish_reason)
        assert reqs[i].error is None
    _same_logprobs(reqs[2].prompt_logprobs, plain[2].prompt_logprobs, TOL)
    _same_logprobs(reqs[2].output_logprobs, plain[2].output_logprobs, TOL)
    assert eng.runner.graph_runner.runs > 0


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["eagle3", "moa"])
def test_gpu_chained_logprobs_equal_the_plain_loop(smollm2_cuda, drafter):
    """On CUDA (bf16, graphs captured): tokens as the loop without overlap, logprobs within a bf16 logit's rounding
    at SmolLM2's logit scale (the two loops' verify graphs differ in shape); every verify a chained spec step with
    one copy."""
    plain = _run(smollm2_cuda, False, drafter)[1]
    gpu_equal_to_the_plain_loop(*_run(smollm2_cuda, True, drafter), plain)


def gpu_equal_to_the_plain_loop(eng, reqs, plain) -> None:
    """On CUDA: every step a graph replay with one copy; tokens and ends as the loop without overlap's (`plain`), each
    logprobs request's logprobs within a bf16 logit's rounding at SmolLM2's logit scale."""
    g = eng.runner.graph_runner
    assert g.graphs and eng.runner.stream.copies == g.runs > 0
    assert [(r.output_ids, r.finish_reason) for r in reqs] == [(r.output_ids, r.finish_reason) for r in plain]
    for r, p in zip(reqs, plain):
        if r.params.logprobs is not None:
            _same_logprobs(r.output_logprobs, p.output_logprobs, 0.25)
