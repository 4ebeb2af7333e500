"""Requests that ask for logprobs without a drafter in the overlapped loop (serving/decode_step.py): greedy or sampled
(seeded), penalized or not, with top_logprobs or not, they ride the chained plain decode steps beside requests that
ask for none. The decode graph takes each row's logprob and its K likeliest from the raw logits with the chained spec
verify's ops for a root-only row (models/decode_graphs.py: spec_graphs.graph_path_logprobs) and they come up in the
step's one copy with the tokens, so every token and logprob is the loop without overlap's (its ordinary step:
verify.path_logprobs on the raw logits), within test_engine_spec_overlap_logprobs.py's tolerance.

On the CPU the device is `helpers.QueuedStream` (as in test_engine_overlap_sampled.py). The scenario: requests with
top_logprobs 1, 0, 5 and 3 (greedy; seeded sampled; seeded sampled with top_p and a frequency penalty; greedy with a
repetition penalty) beside a greedy one (ending at a stop id, its surplus row dropped) and a seeded sampled one
without logprobs, of different lengths, so that the chain's batches ask for different widest top_logprobs (K 8, 4,
1: a graph each), then none (the longest, sampled without logprobs, alone). The outputs' check fails with the
logprobs left out, taken from the penalized logits or read at another column; the chains' check fails where
logprobs requests take the ordinary step. The `gpu` case runs the scenario on CUDA's stream with captured graphs.
"""

from __future__ import annotations

import pytest
from helpers import step_order
from test_engine_overlap_sampled import PERIOD, TREE, plain_and_overlapped
from test_engine_spec_overlap_logprobs import TOL, _same_logprobs, gpu_equal_to_the_plain_loop
from test_engine_spec_overlap_sampled import _engine, drive

from serving.spec_step import top_bucket
from sglang_ext.sampling import SamplingParams

REQUESTS = [  # (prompt, params): with logprobs (greedy, sampled, penalized) and without, of different lengths
    ("Count from one to twenty in words.", SamplingParams(max_new_tokens=22, logprobs=1)),
    (
        "Write a haiku about rivers.",
        SamplingParams(max_new_tokens=10, temperature=0.9, seed=11, logprobs=0),
    ),
    (
        "Tell me a story.",
        SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, seed=13, frequency_penalty=0.8, logprobs=5),
    ),
    ("Name three rivers.", SamplingParams(max_new_tokens=12, repetition_penalty=1.5, logprobs=3)),
    ("List four fruits.", SamplingParams(max_new_tokens=14, stop_token_ids=[PERIOD])),
    ("What is 7*8?", SamplingParams(max_new_tokens=26, temperature=0.8, seed=9)),  # (alone in the last steps)
]


def _run(target, overlap: bool, stream=None):
    """The scenario through Engine.step -> (the engine, its requests)."""
    return drive(_engine(target, overlap, None, TREE, stream), target, REQUESTS)


@pytest.fixture(scope="module")
def runs(smollm2_fp32):
    """The scenario in the loop without overlap and in the overlapped loop on a stand-in stream."""
    return plain_and_overlapped(smollm2_fp32, _run)


def test_tokens_and_logprobs_equal_the_plain_loop(runs):
    """Token for token, finish reasons and verify steps as the loop without overlap; each logprobs request's logprobs
    (one per output token: the chosen token's, its top_logprobs alternatives, likeliest first) as its too."""
    _, plain = runs["plain"]
    _, reqs, *_ = runs["overlap"]
    ends = lambda rs: [(r.output_ids, r.finish_reason, r.stats.verify_steps) for r in rs]  # noqa: E731
    assert ends(reqs) == ends(plain)
    for r, p in zip(reqs, plain):
        if r.params.logprobs is None:
            assert r.output_logprobs == [] == p.output_logprobs
            continue
        assert [lp.token for lp in r.output_logprobs] == r.output_ids
        assert all(len(lp.top) == r.params.logprobs for lp in r.output_logprobs)
        _same_logprobs(r.output_logprobs, p.output_logprobs, TOL)


def test_every_decode_step_chains(runs):
    """Every decode step is a chained plain decode step, read after the next one was issued, with one copy, while
    requests with and without logprobs (greedy, sampled, penalized) share it, the batch's K going 8, 4, 1, then none
    (each a graph of its own)."""
    eng, reqs, stream, seen = runs["overlap"]
    ahead, behind = step_order(stream.log)
    assert behind == [] and len(ahead) == len(seen) - 1 >= 18, (ahead, behind)  # (the last, surplus, never read)
    assert stream.copies == eng.runner.graph_runner.runs == len(seen)
    assert [chained for chained, _ in seen] == [False] + [True] * (len(seen) - 1)  # (one chain, never ended)
    asked = {r.rid: r.params.logprobs for r in reqs if r.params.logprobs is not None}
    kinds = {r.rid for r in reqs if r.finish_reason == "length"}  # (all but the one a stop id ends at once)
    assert sum(kinds <= set(rids) for _, rids in seen) >= 6 and len(kinds) == 5
    tops = [top_bucket([asked[i] for i in rids if i in asked]) for _, rids in seen]
    assert [k for i, k in enumerate(tops) if i == 0 or tops[i - 1] != k] == [8, 4, 1, None], tops


@pytest.mark.gpu
def test_gpu_tokens_and_logprobs_equal_the_plain_loop(smollm2_cuda):
    """On CUDA (bf16, graphs captured): tokens as the loop without overlap, logprobs within a bf16 logit's rounding
    at SmolLM2's logit scale (test_engine_spec_overlap_logprobs.py's); every decode step a graph replay with one
    copy."""
    _, plain = _run(smollm2_cuda, False)
    gpu_equal_to_the_plain_loop(*_run(smollm2_cuda, True), plain)
