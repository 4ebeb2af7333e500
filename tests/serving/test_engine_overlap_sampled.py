"""Sampled requests without a drafter in the overlapped loop (serving/decode_step.py): a request with a temperature
(top_k / top_p or not, seeded or not, penalties and min_tokens or not; no grammar; with logprobs:
test_engine_overlap_logprobs.py) rides the chained plain decode steps beside greedy ones. The decode graph takes each
sampled row's token as its coupled sample (models/decode_graphs.py: sampling.coupled_tokens, the chained spec
verify's ops, Gumbel-max with the (seed, position) noise, which is the ordinary step's verify.coupled_path for a
root-only tree), so a seeded request's output is the loop without overlap's, token for token.

On the CPU the device is `helpers.QueuedStream` (as in test_engine_overlap.py): the device runs late, so a token the
graph did not draw itself (a host read one step behind, the future token of another row) changes the outputs. The
scenario: seeded sampled requests (a plain temperature, top_p, top_k, both, a frequency penalty, min_tokens, a stop
id) beside a greedy one and a penalized greedy one, with different lengths, so that they end at different steps of
the chain (by their length, EOS and a stop id); a seeded sampled arrival with a penalty joins while the chain runs
(its prefill beside the step in flight); one sampled request is aborted mid-chain. The outputs' check fails with the
sampled rows' noise at another position, with their argmax instead of their sample, or with the penalties left out
of the graph; the chains' checks fail where sampled requests take the ordinary step. The law of unseeded chained
plain decoding is tests/sglang_ext/test_distribution.py's (test_chained_unseeded_plain_decode_matches_target). The
`gpu` case runs the scenario on CUDA's stream with captured graphs.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
from helpers import QueuedStream, prefill_copies, prefills_in_flight, step_order
from test_engine_spec_overlap_sampled import _engine, drive

from serving import decode_step
from serving.decode_step import plain_decode
from sglang_ext.grammar import GrammarSpec
from sglang_ext.sampling import SamplingParams
from sglang_ext.tree import TreeShape

PERIOD, EOS = 30, 2  # SmolLM2's "." (a stop id) and <|im_end|>
TREE = TreeShape(3, 2, 6)  # (the engine's configured tree: no drafter, so no step drafts)
REQUESTS = [  # (prompt, params): seeded sampled ones of every kind, and greedy ones, of different lengths
    ("Write a haiku about rivers.", SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=11)),
    ("List four fruits.", SamplingParams(max_new_tokens=12, temperature=1.0, top_k=50, seed=12)),
    ("Tell me a story.", SamplingParams(max_new_tokens=20, temperature=0.7, seed=13, frequency_penalty=0.8)),
    ("Hi!", SamplingParams(max_new_tokens=18, temperature=0.7, seed=3, min_tokens=14)),
    (
        "Say OK.",
        SamplingParams(max_new_tokens=24, temperature=0.3, top_k=20, top_p=0.9, seed=4, stop_token_ids=[PERIOD]),
    ),
    ("Count from one to twenty in words.", SamplingParams(max_new_tokens=8)),
    ("Name three rivers.", SamplingParams(max_new_tokens=10, repetition_penalty=1.5)),
    ("What is 7*8?", SamplingParams(max_new_tokens=30, temperature=0.8, seed=9)),  # aborted mid-chain
]
ABORTED, ABORT_AT = 7, 7  # aborted once it has this many tokens (read: the step in flight has more)
LATE = ("Reply with one word: yes or no?", SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=5,
                                                          presence_penalty=1.0))  # fmt: skip
ARRIVE_AFTER = 3  # engine steps (LATE arrives while a chain runs)


@contextmanager
def _recorded(seen: list):
    """decode_step's launches as the loop issues them, recorded in `seen`: per plain decode step, (whether it continues
    a chain: issued while the step before it is in flight, the ids of its requests)."""
    real = decode_step.PLAIN.launch

    def launch(engine, reqs, prev=None):
        seen.append((prev is not None, [r.rid for r in reqs]))
        return real(engine, reqs, prev)

    decode_step.PLAIN.launch = staticmethod(launch)
    try:
        yield seen
    finally:
        decode_step.PLAIN.launch = staticmethod(real)


def _run(target, overlap: bool, stream=None):
    """The scenario through Engine.step -> (the engine, its requests)."""
    eng = _engine(target, overlap, None, TREE, stream)

    def after_step(step: int, reqs: list) -> None:
        if step == ARRIVE_AFTER:
            reqs.append(eng.add_request(target.encode_chat([{"role": "user", "content": LATE[0]}]), LATE[1]))
        if len(reqs[ABORTED].output_ids) >= ABORT_AT and not reqs[ABORTED].finished:
            eng.abort(reqs[ABORTED])

    return drive(eng, target, REQUESTS, after_step)


def _ends(reqs) -> list:
    return [(r.output_ids, r.finish_reason, r.stats.verify_steps) for r in reqs]


def plain_and_overlapped(target, run) -> dict:
    """run(target, overlap, stream=None) -> (engine, requests): a scenario in the loop without overlap ("plain") and in
    the overlapped loop on a stand-in stream ("overlap": the engine, requests, stream and its plain decode launches)."""
    plain = run(target, False)
    stream, seen = QueuedStream(), []
    try:
        with _recorded(seen):
            eng, reqs = run(target, True, stream)
    finally:
        stream.close()
    return {"plain": plain, "overlap": (eng, reqs, stream, seen)}


@pytest.fixture(scope="module")
def runs(smollm2_fp32):
    """The scenario in the loop without overlap and in the overlapped loop on a stand-in stream."""
    return plain_and_overlapped(smollm2_fp32, _run)


def test_the_scenario_ends_requests_every_way(runs):
    """Requests end mid-chain by their length, EOS, a stop id and an abort (the plain loop's ends)."""
    _, reqs = runs["plain"]
    reasons = [r.finish_reason for r in reqs]
    assert reasons[ABORTED] == "abort" and {"length", "stop"} <= set(reasons), reasons
    stops = {r.output_ids[-1] for r in reqs if r.finish_reason == "stop"}
    assert {EOS, PERIOD} <= stops, stops
    assert len({len(r.output_ids) for r in reqs}) >= 5  # (they end at different steps)


def test_seeded_sampled_outputs_equal_the_plain_loop(runs):
    """Token for token, finish reasons and verify steps: the overlapped loop's as the loop without overlap's."""
    _, plain = runs["plain"]
    _, reqs, *_ = runs["overlap"]
    assert _ends(reqs) == _ends(plain)


def test_every_decode_step_chains(runs):
    """Every decode step is a chained plain decode step, read after the next one was issued, with one copy; the
    arrival's prefill rides beside the step in flight."""
    eng, _, stream, seen = runs["overlap"]
    ahead, behind = step_order(stream.log)
    assert behind == [] and len(ahead) == len(seen) - 1 >= 18, (ahead, behind)  # (the last, surplus, never read)
    assert [read for _, read in prefills_in_flight(stream.log)] == [False]
    assert stream.copies - len(prefill_copies(stream.log)) == eng.runner.graph_runner.runs == len(seen)
    assert [chained for chained, _ in seen] == [False] + [True] * (len(seen) - 1)  # (one chain, never ended)


def test_mixed_batches_ride_one_chain(runs):
    """The chain's steps hold sampled, penalized, min_tokens and greedy rows together, and the arrival joins it."""
    _, reqs, _, seen = runs["overlap"]
    rid = lambda i: reqs[i].rid  # noqa: E731
    kinds = {rid(0), rid(2), rid(3), rid(5), rid(6)}  # (top_p, a penalty, min_tokens, greedy, greedy penalized)
    assert sum(kinds <= set(rids) for _, rids in seen) >= 6
    late = [i for i, (_, rids) in enumerate(seen) if reqs[-1].rid in rids]
    assert late and seen[late[0]][0] and len(seen[late[0]][1]) > 1, seen  # (it joined a chain in flight)


def test_what_rides_the_chained_plain_decode_steps(smollm2_fp32):
    """plain_decode in the overlapped loop: sampled requests, seeded or not, filtering or not, with penalties or
    min_tokens or logprobs (test_engine_overlap_logprobs.py), beside greedy ones; not one with a grammar (its mask is
    the host's). Without overlap, only plain greedy ones without logprobs (the ordinary step takes the others)."""
    stream = QueuedStream()
    try:
        eng = _engine(smollm2_fp32, True, None, TREE, stream)
        plain_eng = _engine(smollm2_fp32, False, None, TREE)
        add = lambda e, **kw: e.add_request([1, 9690, 30], SamplingParams(max_new_tokens=4, **kw))  # noqa: E731
        greedy, seeded, unseeded = add(eng), add(eng, temperature=0.8, seed=1), add(eng, temperature=1.2)
        filtered, penalized = add(eng, temperature=0.5, top_k=3, top_p=0.5), add(eng, temperature=0.8, min_tokens=3)
        lps, grammar = add(eng, temperature=0.8, seed=2, logprobs=1), add(eng, grammar=GrammarSpec("regex", "[ab]+"))
        eng.step()  # (their prefills)
        assert plain_decode(eng, [seeded]) and plain_decode(eng, [greedy, seeded, unseeded, filtered, penalized])
        assert plain_decode(eng, [greedy, seeded, lps]) and grammar.matcher is not None
        assert not plain_decode(eng, [greedy, grammar])
        p_greedy, p_seeded = add(plain_eng), add(plain_eng, temperature=0.8, seed=1)
        p_lps = add(plain_eng, logprobs=1)
        plain_eng.step()
        assert plain_decode(plain_eng, [p_greedy]) and not plain_decode(plain_eng, [p_greedy, p_seeded])
        assert not plain_decode(plain_eng, [p_greedy, p_lps])
    finally:
        stream.close()


@pytest.mark.gpu
def test_gpu_seeded_sampled_outputs_equal_the_plain_loop(smollm2_cuda):
    """On CUDA (bf16, graphs captured): the overlapped loop's tokens as the loop without overlap's."""
    _, plain = _run(smollm2_cuda, False)
    eng, reqs = _run(smollm2_cuda, True)
    assert eng.runner.graph_runner.graphs and _ends(reqs) == _ends(plain)
