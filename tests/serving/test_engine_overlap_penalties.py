"""Penalties and min_tokens in the overlapped loop (serving/decode_step.py, serving/spec_step.py): a request with a
frequency, presence or repetition penalty, or with min_tokens still ahead, rides the chained steps (plain decode steps
and drafted ones), its logits penalized inside the step's graph from state kept on the device
(models/penalty_graphs.py), each tree node after its own path, as the ordinary step's host path does
(Sampler.constrained). Outputs equal the loop without overlap's, token for token, and the chain does not end for them.

On the CPU the device is `helpers.QueuedStream` (as in test_engine_overlap.py): the device runs late, so a state the
graph did not bring up to date itself (a penalty counted from a stale output, a min_tokens length one step behind)
changes the tokens. The requests: greedy ones with each penalty kind and a logit bias, greedy ones whose EOS or stop
id comes early held off by min_tokens, seeded sampled ones with a penalty or min_tokens (one with logprobs: the raw
logits', as the ordinary step's), plain ones beside them, and an arrival with a penalty and min_tokens while a chain
runs (its prefill beside the step in flight, its first token under its rules); without a drafter (chained plain
decode steps: the greedy requests) and with EAGLE-3 and MoA (chained drafted steps: all of them); and a penalized
request whose drafter fails mid-chain, riding the chains as a root-only row; EAGLE-3 under the adaptive policy, its
chains ending and starting again. Each check fails with the rules left out of the chained graphs, or with their state
not brought up to the step (the counts or the output length of the step before left out);
tests/sglang_ext/test_penalty_graphs.py checks the graphs' rows against the host path's bit for bit, each tree node
after its own path. The `gpu` case runs the scenario on CUDA's stream with captured graphs.
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
from test_engine_spec_overlap import FAULTY, _in_order, _poison, _recorded, scripted_policy
from test_engine_spec_overlap_logprobs import TOL, _same_logprobs
from test_engine_spec_overlap_sampled import _engine, drive

from serving.engine import Engine
from sglang_ext.sampling import SamplingParams
from sglang_ext.tree import TreeShape

TREE = TreeShape(3, 2, 6)
PERIOD = 30  # SmolLM2's "." (a stop id)
GREEDY = [  # (prompt, params): greedy, each penalty kind, min_tokens past an early EOS and an early stop id, a bias
    ("Name three rivers.", SamplingParams(max_new_tokens=14, repetition_penalty=1.5)),
    ("Count from one to twenty in words.", SamplingParams(max_new_tokens=14, frequency_penalty=0.9)),
    ("Count from one to twenty in words.", SamplingParams(max_new_tokens=12, presence_penalty=1.5)),
    ("Hi!", SamplingParams(max_new_tokens=20, min_tokens=14)),
    ("Say OK.", SamplingParams(max_new_tokens=16, stop_token_ids=[PERIOD], min_tokens=10)),
    ("What is 7*8?", SamplingParams(max_new_tokens=10)),  # plain greedy beside them
    ("What is 7*8?", SamplingParams(max_new_tokens=10, logit_bias=((2068, -100.0),))),  # (2068: its first token)
]
SAMPLED = [  # seeded sampled: a penalty, min_tokens past an early EOS, another penalty
    ("Write a haiku about rivers.", SamplingParams(max_new_tokens=14, temperature=0.8, seed=5, frequency_penalty=1.5)),
    ("Hi!", SamplingParams(max_new_tokens=18, temperature=0.7, seed=3, min_tokens=14)),
    (
        "Tell me a story.",
        SamplingParams(max_new_tokens=10, temperature=0.9, seed=7, repetition_penalty=1.3, logprobs=2),
    ),
]

LATE = ("Reply with one word: yes or no?", SamplingParams(max_new_tokens=8, repetition_penalty=1.3, min_tokens=4))
ARRIVE_AFTER = 3  # engine steps (LATE arrives while a chain runs: its prefill rides beside the step in flight)


def _run(target, overlap: bool, drafter: str | None, requests, stream=None):
    eng = _engine(target, overlap, drafter, TREE, stream)

    def after_step(step: int, reqs: list) -> None:
        if step == ARRIVE_AFTER:
            reqs.append(eng.add_request(target.encode_chat([{"role": "user", "content": LATE[0]}]), LATE[1]))

    return drive(eng, target, requests, after_step)


def _ends(reqs) -> list:
    return [(r.output_ids, r.finish_reason) for r in reqs]


def _overlapped(target, drafter, requests):
    stream = QueuedStream()
    try:
        eng, reqs = _run(target, True, drafter, requests, stream)
    finally:
        stream.close()
    return eng, reqs, stream


@pytest.fixture(scope="module")
def vanilla(smollm2_fp32):
    """The loop without overlap, no drafter: plain (penalized, seeded) decoding."""
    return _run(smollm2_fp32, False, None, GREEDY + SAMPLED)[1]


def test_the_rules_change_the_outputs(smollm2_fp32, vanilla):
    """The scenario exercises them: each penalty changes its request's tokens, min_tokens holds off the EOS plain
    decoding would end at and the stop id sampling would."""
    bare = [(t, SamplingParams(max_new_tokens=p.max_new_tokens, temperature=p.temperature, seed=p.seed,
                               stop_token_ids=p.stop_token_ids)) for t, p in GREEDY + SAMPLED + [LATE]]  # fmt: skip
    plain = _run(smollm2_fp32, False, None, bare[:-1])[1]
    pairs = list(zip(vanilla, plain))[:-1]  # (LATE, penalized in both, aside)
    for r, b in pairs:
        if r.params.penalized or r.params.min_tokens:
            assert r.output_ids != b.output_ids, r.params
    early = [(r, b) for r, b in pairs if r.params.min_tokens]
    assert len(early) == 3 and all(b.finish_reason == "stop" for _, b in early)
    assert all(len(b.output_ids) < r.params.min_tokens <= len(r.output_ids) for r, b in early)


def test_chained_plain_decode_steps_apply_them(smollm2_fp32, vanilla):
    """Without a drafter (greedy requests: the chained plain decode steps' kind): the overlapped loop's outputs are
    the ordinary loop's, and every decode step is a chained one (read after the next one was issued)."""
    eng, reqs, stream = _overlapped(smollm2_fp32, None, GREEDY)
    plain = _run(smollm2_fp32, False, None, GREEDY)[1]
    assert _ends(reqs) == _ends(plain) and _ends(reqs[:-1]) == _ends(vanilla[: len(GREEDY)])
    ahead, behind = step_order(stream.log)
    assert behind == [] and len(ahead) >= 12, (ahead, behind)
    assert [read for _, read in prefills_in_flight(stream.log)] == [False]  # (LATE's, beside the step in flight)
    assert stream.copies - len(prefill_copies(stream.log)) == eng.runner.graph_runner.runs  # (a copy per step)


@pytest.mark.parametrize("drafter", ["eagle3", "moa"])
def test_chained_drafted_steps_apply_them(smollm2_fp32, vanilla, drafter):
    """With a drafter, greedy and seeded sampled requests together: the overlapped loop's outputs are the ordinary
    loop's and plain decoding's, and every drafted step is a chained one with its one copy."""
    plain = _run(smollm2_fp32, False, drafter, GREEDY + SAMPLED)[1]
    eng, reqs, stream = _overlapped(smollm2_fp32, drafter, GREEDY + SAMPLED)
    assert _ends(reqs) == _ends(plain) == _ends(vanilla)
    lp = len(GREEDY) + 2  # (the raw logits' logprobs, as the ordinary step's)
    _same_logprobs(reqs[lp].output_logprobs, plain[lp].output_logprobs, TOL)
    ahead, behind = step_order(stream.log)
    assert behind == [] and len(ahead) >= 6, (ahead, behind)
    assert [read for _, read in prefills_in_flight(stream.log)] == [False]
    assert stream.copies - len(prefill_copies(stream.log)) == eng.runner.graph_runner.runs  # (a copy per step)
    assert sum(r.stats.accepted_tokens for r in reqs) > 0


def _faulty(target, overlap: bool):
    """EAGLE-3 with test_engine_spec_overlap's faulty drafter (FAULTY's trees drafted outside the vocabulary at its
    second and third searches): FAULTY (penalized, min_tokens ahead) falls back mid-chain -> (the requests, seen: as
    _recorded's)."""
    stream, seen, run = QueuedStream() if overlap else None, {}, Engine._run
    if stream is not None:  # (FAULTY's last steps, alone and drafting nothing, take the ordinary step)
        Engine._run = _in_order(stream, run)
    try:
        eng = _engine(target, overlap, "eagle3", TREE, stream)
        _poison(eng, seen)
        encode = lambda text: target.encode_chat([{"role": "user", "content": text}])  # noqa: E731
        faulty = ("Hi!", SamplingParams(max_new_tokens=20, min_tokens=14, presence_penalty=1.0))
        reqs = [eng.add_request(encode(t), p) for t, p in [GREEDY[1], faulty, SAMPLED[0], GREEDY[5]]]
        with _recorded(seen):
            for _ in range(60):
                if not eng.has_work:
                    break
                eng.step()
        assert not eng.has_work and slots_whole(eng) and drafter_pools_whole(eng.drafter)
    finally:
        Engine._run = run
        if stream is not None:
            stream.close()
    return reqs, seen


def test_a_penalized_request_rides_the_chains_as_a_root_only_row(smollm2_fp32):
    """A penalized request whose drafter failed mid-chain rides the chained steps as a root-only row (its root the
    bonus token of its row in the step before, on the device), its rules applied there: every output the loop
    without overlap's with the same fault."""
    plain, _ = _faulty(smollm2_fp32, False)
    reqs, seen = _faulty(smollm2_fp32, True)
    assert [r.drafting for r in reqs] == [r.rid != FAULTY for r in reqs] == [r.drafting for r in plain]
    assert any(ride.get(FAULTY) for ride in seen["rides"]), seen["rides"]  # (a chained root-only row, root on device)
    assert _ends(reqs) == _ends(plain)


def test_under_the_policy_penalized_outputs_are_the_ordinary_loops(smollm2_fp32, vanilla):
    """Under the adaptive policy (scripted: off and the smaller tree between the configured tree's steps, so chains
    start, end and restart; EAGLE-3), every output is the ordinary loop's, and chained steps ran: each chain's first
    step writes its requests' state from the host, whatever ran before it (with a state kept from an earlier chain
    instead, outputs differ: checked)."""
    stream = QueuedStream()
    with scripted_policy(stream):
        eng, reqs = _run(smollm2_fp32, True, "eagle3", GREEDY + SAMPLED, stream)
    assert _ends(reqs) == _ends(vanilla)
    assert sum(c for c, _ in eng.policy.kinds) >= 2 and {o for o, *_ in eng.policy.seen} == {0, 1, 2}


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", [None, "eagle3"])
def test_gpu_chained_outputs_equal_the_plain_loop(smollm2_cuda, drafter):
    """On CUDA (bf16, graphs captured): the overlapped loop's tokens as the loop without overlap's, a copy per step."""
    requests = GREEDY if drafter is None else GREEDY + SAMPLED
    plain = _run(smollm2_cuda, False, drafter, requests)[1]
    eng, reqs = _run(smollm2_cuda, True, drafter, requests)
    g = eng.runner.graph_runner
    assert g.graphs and _ends(reqs) == _ends(plain)
