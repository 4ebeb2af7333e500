"""The overlapped loop's drafted steps (serving/spec_step.py): a greedy EAGLE-3 or MoA step N+1 (the drafter's commit
of step N's accepted tokens with its search, then the verify) is issued before step N's accept results are read, each
step's results come up in one device-to-host copy, and every request's output is the loop without overlap's.

On the CPU the device is `helpers.QueuedStream` (the target's and the drafter's graphs, fills, table writes and copies
queued and run in order by a worker thread only once the host waits): a host read of device state outside the step's
copy sees stale values, and so does the device of host state changed after the launch that reads it, so the outputs
would differ. The real SmolLM2 target (fp32) with the shipped EAGLE-3 and MoA heads decodes chat prompts that end every
way: max_tokens, EOS, a stop id, an abort mid-batch, and an arrival mid-batch (its prefill issued beside the chained
step in flight, before that step is read, and it joins the chains; with and without the adaptive policy; more arrival
patterns in test_engine_overlap_arrivals.py); a drafter's faulty tree mid-chain sends its request back to vanilla
decoding, and the others keep chaining with it beside them as a root-only row. The loop without overlap runs on the
CPU's synchronous stream: the engine's ordinary drafted step. The `gpu` cases run the same scenarios on CUDA's stream
with captured graphs.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
from helpers import (
    QueuedStream,
    copies_read_after_the_next,
    drafter_pools_whole,
    log_cuda_copies,
    prefill_copies,
    prefills_in_flight,
    slots_whole,
    step_order,
)

import serving.spec_step as spec_mod
from serving.adaptive import CONFIDENT_FROM_BATCH, AdaptiveSpeculation
from serving.config import EngineConfig
from serving.decode_step import OverlappedLoop
from serving.engine import Engine
from serving.spec_step import Chained, spec_chains
from sglang_ext.drafters import make_drafter
from sglang_ext.grammar import GrammarSpec
from sglang_ext.models.graph_runner import GraphRunner
from sglang_ext.sampling import SamplingParams
from sglang_ext.tree import TreeShape

PERIOD, EOS = 30, 2  # SmolLM2's "." (a stop id) and <|im_end|>
TREE = TreeShape(3, 2, 6)  # (no min_prob: on the CPU a search with one runs step by step, outside the graphs)
# (prompt, params): ends by its length, by EOS, by a stop id, aborted (ABORT_AFTER steps) before its length
REQUESTS = [
    ("Name three rivers.", SamplingParams(max_new_tokens=9)),
    ("Hi!", SamplingParams(max_new_tokens=16)),
    ("Say OK.", SamplingParams(max_new_tokens=16, stop_token_ids=[PERIOD])),
    ("Count from one to twenty in words.", SamplingParams(max_new_tokens=40)),
]
LATE = ("Reply with one word: yes or no?", SamplingParams(max_new_tokens=8))  # arrives after ARRIVE_AFTER steps
ARRIVE_AFTER, ABORT_AFTER = 3, 8  # engine steps


def _engine(target, overlap: bool, stream=None, drafter: str | None = "eagle3") -> Engine:
    """The drafter (None: plain decode steps) on the graph runner's static path (the CPU: on `stream`, or its
    synchronous one), its search static. prefill "separate": every decode step of both loops replays the graphs (the
    CPU's eager mixed forward rounds differently from them)."""
    config = EngineConfig(overlap=overlap, prefill="separate", kv_slots=2048, tree=TREE, adaptive=False)
    eng = Engine(target, make_drafter(drafter, target) if drafter else None, config)
    if eng.runner.graph_runner is None:  # (the CPU: the graph runner's static path run eagerly)
        eng.runner.graph_runner = GraphRunner(eng.model, eng.capture_layers, stream=stream)
        if eng.drafter is not None:
            eng.drafter.step_graphs = True
    return eng


def _scenario(target, overlap: bool, stream=None, drafter: str = "eagle3", extra=(), late=True, seen=None):
    """The requests above (and `extra` ones after them; LATE when `late`) through Engine.step -> (the engine, its
    requests). seen (a dict, for _recorded): at LATE's arrival, "issued": the chained steps issued so far,
    "inflight": the ids of the requests live in the chained step in flight (None: no chained step in flight)."""
    eng = _engine(target, overlap, stream, drafter)
    encode = lambda text: target.encode_chat([{"role": "user", "content": text}])  # noqa: E731
    reqs = [eng.add_request(encode(t), p) for t, p in [*REQUESTS, *extra]]
    steps = 0
    while eng.has_work:
        eng.step()
        steps += 1
        if steps == ARRIVE_AFTER and late:
            if seen is not None:
                step = eng.overlap.inflight
                seen["issued"] = len(seen["launches"])
                seen["inflight"] = sorted(step.live) if isinstance(step, Chained) else None
            reqs.append(eng.add_request(encode(LATE[0]), LATE[1]))
        if steps == ABORT_AFTER:
            eng.abort(reqs[3])
        assert steps < 80
    return eng, reqs


def _summary(eng: Engine, reqs) -> list:
    assert slots_whole(eng), "KV slots leaked"
    assert drafter_pools_whole(eng.drafter), "drafter slots leaked"
    stats = [
        (r.stats.verify_steps, r.stats.draft_tokens, r.stats.accepted_tokens, r.stats.accepted_by_depth) for r in reqs
    ]
    return [(r.output_ids, r.finish_reason) for r in reqs] + stats + [eng.prefix_cache.tokens, len(eng.drafter.kept)]


@pytest.fixture(scope="module", params=["eagle3", "moa"])
def runs(smollm2_fp32, request):
    """Per drafter, the scenario without overlap (the synchronous stream), with it, and with each chained step read at
    once (the chain never continued: every drafted step launched and read in its own Engine.step), the last two on
    stand-in streams of their own."""
    drafter = request.param
    out = {"plain": (*_scenario(smollm2_fp32, False, None, drafter), None), "seen": {}}
    for name in ("overlap", "at_once"):
        stream = QueuedStream()
        step = OverlappedLoop.step
        try:
            if name == "at_once":
                OverlappedLoop.step = lambda self: None  # (Engine._run's chained step, read at once)
            seen = out["seen"] if name == "overlap" else {}
            with _recorded(seen):
                eng, reqs = _scenario(smollm2_fp32, True, stream, drafter, seen=seen)
        finally:
            OverlappedLoop.step = step
            stream.close()
        out[name] = (eng, reqs, stream)
    return out


@contextmanager
def _recorded(seen: dict):
    """spec_step.launch recorded in seen["launches"]: per chained step issued, (whether it continues a chain: issued
    while the step before it is in flight, the ids of its requests with a drafted tree); in seen["rides"]: per step,
    {id: whether its root is the bonus token of its row in the step before} of its root-only rows."""
    real, seen["launches"], seen["rides"] = spec_mod.launch, [], []

    def launch(engine, reqs, prev=None):
        step = real(engine, reqs, prev)
        if step is not None:
            seen["launches"].append((prev is not None, [r.rid for r in reqs if r.rid not in step.plain]))
            seen["rides"].append({rid: prev is not None and rid in prev.live for rid in step.plain})
        return step

    spec_mod.launch = launch
    try:
        yield seen
    finally:
        spec_mod.launch = real


def test_the_drafted_scenario_ends_requests_every_way(runs):
    _, reqs, _ = runs["plain"]
    assert [r.finish_reason for r in reqs] == ["length", "stop", "stop", "abort", "stop"]
    assert reqs[1].output_ids[-1] == EOS and reqs[2].output_ids[-1] == PERIOD  # by EOS, by its stop id
    assert len(reqs[0].output_ids) == 9 and len(reqs[3].output_ids) < 40
    assert all(r.stats.accepted_tokens > 0 for r in reqs[:4])  # (drafts were accepted: multi-token steps)


@pytest.mark.parametrize("name", ["overlap", "at_once"])
def test_overlapped_drafted_outputs_equal_the_plain_loop(runs, name):
    """Token for token, finish reasons, verify steps, drafts and acceptance, the prefix cache's tokens, what the
    drafter keeps beside it; no slot of the target's or the drafter's pools leaked."""
    eng, reqs, stream = runs[name]
    assert _summary(eng, reqs) == _summary(*runs["plain"][:2])
    # (every verify a chained spec step's; overlapped, the arrival's prefill has a copy of its own)
    assert stream.copies - len(prefill_copies(stream.log)) == eng.runner.graph_runner.runs > 0
    if name == "overlap":  # (the last step, all its results surplus, was issued and never read)
        assert isinstance(eng.overlap.inflight, Chained) and not eng.overlap.inflight.live


def _order(stream: QueuedStream) -> tuple[list[int], list[int]]:
    """(the steps read after the next step's copy was issued, those read before it), from the stream's log, the
    arrivals' prefills' copies aside."""
    return step_order(stream.log)


def test_drafted_step_n_plus_1_is_issued_before_step_n_is_read(runs):
    """Overlapped: every drafted step is read after the next one's graphs (the drafter's commit with the search, the
    verify) and copy were issued, the arrival's too (arrivals end no chain: its prefill was issued while the step in
    flight was not read yet). Read at once, none is."""
    stream = runs["overlap"][2]
    ahead, behind = _order(stream)
    assert behind == [] and len(ahead) >= 6, (ahead, behind)
    assert [read for _, read in prefills_in_flight(stream.log)] == [False]
    skip = set(prefill_copies(stream.log))
    steps = [i for kind, i in stream.log if kind == "copy" and i not in skip]
    for n, after in zip(steps, steps[1:]):  # step N+1's two replays between step N's copy and its read (and where
        if n in ahead:  # an arrival's first token was read there, the drafter's settling of its prompt: EAGLE-3's)
            between = stream.log[stream.log.index(("copy", n)) + 1 : stream.log.index(("read", n))]
            settled = any(e[0] == "read" and e[1] in skip for e in between)
            assert between.count(("replay", None)) in ((2, 3) if settled else (2,)) and ("copy", after) in between
    assert _order(runs["at_once"][2])[0] == []


def _joins_the_chains(seen: dict, reqs) -> None:
    """LATE (the last of reqs) arrived while a chained step, itself issued while the step before it was in flight,
    was in flight with live requests; after its prefill LATE drafts beside them in the chains."""
    launches, at, live = seen["launches"], seen["issued"], seen["inflight"]
    assert live and launches[at - 1][0] and set(live) <= set(launches[at - 1][1]), (seen, at)
    assert any(chained and reqs[-1].rid in rids for chained, rids in launches[at:]), launches[at:]


def test_an_arrival_while_a_chain_is_in_flight_joins_the_chains(runs):
    """Without the policy: LATE arrives while a chain of the four requests is in flight; its prefill is issued before
    the step in flight is read (test_drafted_step_n_plus_1_is_issued_before_step_n_is_read), then it joins the
    chains; its output and every other request's are the plain loop's, no pool leaked
    (test_overlapped_drafted_outputs_equal_the_plain_loop)."""
    _, reqs, _ = runs["overlap"]
    _joins_the_chains(runs["seen"], reqs)
    assert reqs[-1].stats.verify_steps > 0 and reqs[-1].drafting


@pytest.mark.parametrize("name", ["overlap", "at_once"])
def test_one_device_to_host_copy_per_drafted_step(runs, name):
    """A copy per drafted step (its verify) and per arrivals' prefill issued beside one, each read once at most, two
    graph replays per step (the drafter's commit and search, the target's verify); overlapped, only the last (surplus)
    copy is never read."""
    eng, reqs, stream = runs[name]
    reads, prefills = [i for kind, i in stream.log if kind == "read"], prefill_copies(stream.log)
    assert sorted(reads) == list(range(1, stream.copies + 1 - (name == "overlap")))
    settled = stream.log.count(("replay", None)) - 2 * (stream.copies - len(prefills))
    assert 0 <= settled <= len(prefills)  # (and the drafter's settling of the arrival's prompt: EAGLE-3's extend)
    assert max(r.stats.verify_steps for r in reqs) <= stream.copies - len(prefills)


def test_chaining_takes_drafted_steps_of_requests_without_a_grammar(smollm2_fp32):
    """A chained spec step needs the overlapped loop, a drafter that chains, requests without a grammar (greedy or
    sampled: test_engine_spec_overlap_sampled.py; penalties or not: test_engine_overlap_penalties.py), no adaptive
    policy."""
    stream = QueuedStream()
    try:
        eng = _engine(smollm2_fp32, True, stream)
        greedy = eng.add_request([1, 9690, 30], SamplingParams(max_new_tokens=4))
        sampled = eng.add_request([1, 9690, 30], SamplingParams(max_new_tokens=4, temperature=0.8, seed=1))
        penalized = eng.add_request([1, 9690, 30], SamplingParams(max_new_tokens=4, presence_penalty=0.5))
        grammar = eng.add_request(
            [1, 9690, 30], SamplingParams(max_new_tokens=4, grammar=GrammarSpec("regex", "[ab]+"))
        )
        eng.step()  # (their prefills)
        assert spec_chains(eng, [greedy]) and spec_chains(eng, [greedy, sampled])
        assert spec_chains(eng, [greedy, penalized]) and not spec_chains(eng, [greedy, grammar])
        eng.config = replace(eng.config, overlap=False)
        assert not eng.overlap.applies() and not spec_chains(eng, [greedy])
        lookup = Engine(smollm2_fp32, make_drafter("ngram", smollm2_fp32), EngineConfig(prefill="separate"))
        assert not lookup.drafter.chains and make_drafter("moa", smollm2_fp32).chains
    finally:
        stream.close()


@pytest.mark.parametrize("drafter", ["eagle3", "moa"])
def test_a_step_fault_mid_chain_leaves_every_pool_whole(smollm2_fp32, monkeypatch, drafter):
    """A chained step that fails at its launch (its verify, after the drafter's graph was issued) while the step
    before it is in flight: the engine's reset (as the engine loop runs it) frees that step's trees and the drafter's
    state of both, every request fails, nothing leaks."""
    real, calls = spec_mod.verify_spec, []

    def verify_spec(*args):
        calls.append(args[6] is not None)  # (chained: it reads a step in flight)
        if sum(calls) == 2:
            raise RuntimeError("device fault")
        return real(*args)

    monkeypatch.setattr(spec_mod, "verify_spec", verify_spec)
    stream = QueuedStream()
    try:
        eng = _engine(smollm2_fp32, True, stream, drafter)
        encode = lambda text: smollm2_fp32.encode_chat([{"role": "user", "content": text}])  # noqa: E731
        reqs = [eng.add_request(encode(t), SamplingParams(max_new_tokens=40)) for t, _ in REQUESTS]
        with pytest.raises(RuntimeError, match="device fault"):
            for _ in range(10):
                eng.step()
        assert isinstance(eng.overlap.inflight, Chained) and eng.overlap.inflight.live
        pool = eng.kv
        eng.reset()
    finally:
        stream.close()
    assert all(r.finish_reason == "error" for r in reqs) and eng.overlap.inflight is None
    assert eng.kv is pool, "KV slots leaked (the pool was rebuilt)"
    assert slots_whole(eng) and drafter_pools_whole(eng.drafter)


# (RIDER: the fourth request, shorter, so that chains go on after FAULTY's fallback)
RIDER = (REQUESTS[3][0], replace(REQUESTS[3][1], max_new_tokens=12))
FAULTY, POISONED = 1, (2, 3)  # the request (its rid: the second) whose trees draft outside the vocabulary at the
# drafter's calls POISONED


def _poison(eng: Engine, seen: dict, at=POISONED) -> None:
    """The drafter's searches (propose, propose_chained) counted from 1; at the calls `at`, FAULTY's tree (when
    it drafts) drafts a token outside the vocabulary at its first child, on the device after the search (queued on
    the stream: a faulty drafter's graph). seen["poisoned"]: the calls that drafted one."""
    d, vocab, calls = eng.drafter, eng.model.cfg.vocab_size, []
    seen["poisoned"] = []

    def outside(tokens: torch.Tensor) -> None:  # tokens [N] a tree's draft tokens (a view of the packed trees)
        with torch.inference_mode():
            tokens[1] = vocab + 7

    def poisoned(search):
        def propose(batch, shape, *args):
            trees, rids = search(batch, shape, *args), [x.rid for x in batch]
            calls.append(rids)
            if len(calls) in at and FAULTY in rids:
                seen["poisoned"].append(len(calls))
                eng.runner.graph_runner.stream.launch(outside, trees[rids.index(FAULTY)].draft_tokens)
            return trees

        return propose

    d.propose, d.propose_chained = poisoned(d.propose), poisoned(d.propose_chained)


def _faulty_run(target, overlap: bool, drafter: str, policy: bool = False, at_once: bool = False):
    """The first three requests and RIDER, FAULTY's trees poisoned -> (the engine, its requests, the fallbacks heard
    (rid, reason), seen: as _recorded's, "poisoned" as _poison's, the stand-in stream or None). policy: under the
    adaptive policy, its every choice the configured tree (_Scripted: each request drafts as without it; its first
    drafted step is an ordinary one, the catch-up after steps without drafting, never chained). at_once: each
    chained step read at once (as the `runs` fixture's)."""
    cpu = target.model.device.type == "cpu"  # (on CUDA: the device's stream, graphs captured)
    stream, seen, why = QueuedStream() if overlap and cpu else None, {}, []
    run, step = Engine._run, OverlappedLoop.step
    if stream is not None:  # (FAULTY's last steps, alone and drafting nothing, take the ordinary step)
        Engine._run = _in_order(stream, run)
    if at_once:
        OverlappedLoop.step = lambda self: None
    try:
        eng = _engine(target, overlap, stream, drafter)
        eng.on_fallback = lambda r, reason: why.append((r.rid, reason))
        if policy:
            eng.policy = _Scripted(set(), set())
        _poison(eng, seen)
        encode = lambda text: target.encode_chat([{"role": "user", "content": text}])  # noqa: E731
        reqs = [eng.add_request(encode(t), p) for t, p in REQUESTS[:3] + [RIDER]]
        with _recorded(seen):
            for _ in range(40):
                if not eng.has_work:
                    break
                eng.step()
        assert not eng.has_work
    finally:
        Engine._run, OverlappedLoop.step = run, step
        if stream is not None:
            stream.close()
    return eng, reqs, why, seen, stream


@pytest.fixture(scope="module")
def faulty_plain(smollm2_fp32, runs):
    """Per drafter, the faulty scenario without overlap (the synchronous stream)."""
    return _faulty_run(smollm2_fp32, False, runs["plain"][0].drafter.name)


def _falls_back_once(run, plain, fault_free, at: list[int]) -> None:
    """FAULTY fell back once, for its invalid draft, its trees poisoned at the drafter's calls `at` (the plain
    loop's at the first only: its next step drafts no tree for it); the run's outputs, stats, prefix cache and
    drafter's keep as the plain loop's with the same fault, every pool whole; every output fault_free's (the
    requests without a fault: vanilla's greedy; RIDER's as long as the request aborted there)."""
    eng, reqs, why, seen, _ = run
    assert why == plain[2] == [(FAULTY, "invalid_draft")]
    assert seen["poisoned"] == at and plain[3]["poisoned"] == at[:1]
    assert _summary(eng, reqs) == _summary(*plain[:2])
    ends = [(r.output_ids, r.finish_reason) for r in fault_free[:3]]
    assert [(r.output_ids, r.finish_reason) for r in reqs[:3]] == ends
    rider, aborted = reqs[3].output_ids, fault_free[3].output_ids
    assert rider[: len(aborted)] == aborted[: len(rider)] and min(len(rider), len(aborted)) > 8
    assert [r.drafting for r in reqs] == [r.rid != FAULTY for r in reqs]


def _rides_the_chains(seen: dict, first: int) -> None:
    """After FAULTY's last drafted tree (at launch `first` - 1), the chains go on: chained steps with the others'
    trees and FAULTY as a root-only row, its root first the host's (its tree in the step in flight was dropped
    unread), then the bonus token of its row in the step before."""
    launches, rides = seen["launches"], seen["rides"]
    assert [i for i, (_, rids) in enumerate(launches) if FAULTY in rids] == list(range(first)), launches
    after = [(chained, rids, rides[i].get(FAULTY)) for i, (chained, rids) in enumerate(launches) if i >= first]
    assert len(after) >= 2 and all(chained and rids for chained, rids, _ in after), after
    assert [on_device for *_, on_device in after[:2]] == [False, True], after


def test_a_faulty_drafter_mid_chain_falls_back_once(smollm2_fp32, runs, faulty_plain):
    """FAULTY's tree in a chain's second step drafts outside the vocabulary, and so does its tree in the third,
    issued before the second is read: the second's verify flags it in the step's copy; read, FAULTY falls back to
    vanilla decoding, reported once, its work in the third step dropped unread (its tree's slots, its drafter
    state); the others' chains go on, FAULTY in them as a root-only row. As the plain loop with the same fault
    (where the third step drafts no tree for it): tokens, finish reasons, drafts and acceptance, the fallback heard
    at once; every output the plain loop's without a fault (vanilla's greedy); no slot of the target's or the
    drafter's pools leaked."""
    run = _faulty_run(smollm2_fp32, True, runs["plain"][0].drafter.name)
    _falls_back_once(run, faulty_plain, runs["plain"][1][:4], list(POISONED))
    launches, stream = run[3]["launches"], run[4]
    ahead = _order(stream)[0]  # (the second read while the third, FAULTY's tree in it, was in flight; the fourth
    assert launches[1][0] and launches[2][0] and {2, 4, 5} <= set(ahead), (launches, ahead)  # and fifth, FAULTY
    _rides_the_chains(run[3], 3)  # riding them, while the step after each was)


def test_a_fallen_back_request_rides_chained_steps_read_at_once(smollm2_fp32, runs, faulty_plain):
    """With each chained step read at once (every one a chain's first, from the host's state), FAULTY falls back
    at its first poisoned tree and then rides every chained step as a root-only row, its root the host's: as the
    plain loop with the same fault, every output vanilla's greedy, every pool whole."""
    run = _faulty_run(smollm2_fp32, True, runs["plain"][0].drafter.name, at_once=True)
    _falls_back_once(run, faulty_plain, runs["plain"][1][:4], [POISONED[0]])
    launches, rides = run[3]["launches"], run[3]["rides"]
    assert [i for i, (_, rids) in enumerate(launches) if FAULTY in rids] == [0, 1], launches
    assert len(launches) >= 4 and not any(chained for chained, _ in launches), launches
    assert all(ride in ({FAULTY: False}, {}) for ride in rides[2:]) and rides[2] and rides[3], rides


# --- on CUDA: the same scenario on the device's stream, graphs captured ---------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["eagle3", "moa"])
def test_gpu_overlapped_drafted_outputs_equal_the_plain_loop(smollm2_cuda, drafter):
    """Tokens, finish reasons and the prefix cache as the loop without overlap (its ordinary drafted step, the same
    graphs' kinds captured); every verify a chained spec step with one copy."""
    plain = _scenario(smollm2_cuda, False, None, drafter)
    eng, reqs = _scenario(smollm2_cuda, True, None, drafter)
    g = eng.runner.graph_runner
    assert g.graphs and eng.runner.stream.copies == g.runs > 0
    assert slots_whole(eng) and drafter_pools_whole(eng.drafter)
    assert [(r.output_ids, r.finish_reason) for r in reqs] == [(r.output_ids, r.finish_reason) for r in plain[1]]
    assert eng.prefix_cache.tokens == plain[0].prefix_cache.tokens
    assert sum(r.stats.accepted_tokens for r in reqs) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["eagle3", "moa"])
def test_gpu_a_fallen_back_request_rides_the_chains(smollm2_cuda, drafter):
    """The faulty scenario on CUDA: FAULTY falls back once, the others' chains go on with it as a root-only row
    (its root first the host's, then the bonus token on the device); tokens and finish reasons as the loop without
    overlap with the same fault and, for the first three, as the fault-free loop's; every pool whole."""
    eng, reqs, why, seen, _ = _faulty_run(smollm2_cuda, True, drafter)
    plain = _faulty_run(smollm2_cuda, False, drafter)
    fault_free = _scenario(smollm2_cuda, False, None, drafter)[1]
    assert why == plain[2] == [(FAULTY, "invalid_draft")]
    assert slots_whole(eng) and drafter_pools_whole(eng.drafter)
    ends = [(r.output_ids, r.finish_reason) for r in reqs]
    assert ends == [(r.output_ids, r.finish_reason) for r in plain[1]]
    assert ends[:3] == [(r.output_ids, r.finish_reason) for r in fault_free[:3]]
    _rides_the_chains(seen, 3)


@pytest.mark.gpu
def test_gpu_drafted_step_n_plus_1_is_issued_before_step_n_is_read(smollm2_cuda, monkeypatch):
    """The order on CUDA's stream: the copies issued and the waits for them, logged."""
    log = log_cuda_copies(monkeypatch)
    _scenario(smollm2_cuda, True)
    reads, ahead = copies_read_after_the_next(log)  # (the arrival's prefill's copy read after step N+1's was issued)
    assert len(ahead) >= 4 and len(reads) == len(ahead), log


# --- under the adaptive policy: its option chosen one step ahead, the tree in flight chains ----------------------

OFF, SMALL = (
    {8, 9, 18},
    {3, 5, 12, 13, 14},
)  # the scripted policy's decode steps (its choose calls, from 1) off / small tree
LONG = ("Write a short story about a lighthouse.", SamplingParams(max_new_tokens=56, ignore_eos=True))


class _Scripted(AdaptiveSpeculation):
    """The engine's adaptive policy with its choice scripted (off at OFF, the smaller tree at SMALL, the configured
    tree otherwise): chains start, end and restart; every observation recorded."""

    def __init__(self, off=OFF, small=SMALL):
        super().__init__(TREE, confident_from=CONFIDENT_FROM_BATCH, catch_up=True)
        self.off, self.small = off, small
        self.calls, self.seen, self.kinds = 0, [], []  # kinds: per observation (chained, unrated)

    def choose(self, batch_size):
        self.calls += 1
        return 0 if self.calls in self.off else 2 if self.calls in self.small else 1

    def observe(
        self,
        option,
        batch_size,
        seconds,
        tokens,
        rows=None,
        draft_seconds=0.0,
        accepted=None,
        drafted=None,
        first=False,
    ):
        assert seconds > 0 and 0 <= draft_seconds <= seconds
        self.seen.append((option, batch_size, tokens, rows, accepted, drafted))
        chained = sys._getframe(2).f_code.co_name == "_observe"  # (spec_step's, not Engine._run's)
        self.kinds.append((chained, self.options[option] is not None and not self.drafted_last))  # (a switch: unrated)
        super().observe(option, batch_size, seconds, tokens, rows, draft_seconds, accepted, drafted, first)


def _in_order(stream: QueuedStream, run):
    """Engine._run with the stand-in stream in order for the ordinary step (its work run as it is issued): on CUDA
    that step's eager ops queue behind the work it issues and its host reads (its copy, the drafter's) wait for it,
    which the stand-in models for the step's one copy only. What the overlapped loop issued before the step is not
    run here: the loop drains it (OverlappedLoop.drain)."""

    def ordinary(self, reqs, chunks):
        assert not stream.queued, "an ordinary step began with device work the overlapped loop issued still queued"
        put = stream._put
        stream._put = lambda job: stream._wait(put(job)) or stream._issued
        try:
            return run(self, reqs, chunks)
        finally:
            stream._put = put

    return ordinary


@contextmanager
def scripted_policy(stream: QueuedStream | None, policy=_Scripted):
    """Engines made inside run under a scripted adaptive policy (policy(): a fresh one per engine), their ordinary
    step in order on the stand-in `stream` (None: as it is); the stream is closed after."""
    engine, run = Engine.__init__, Engine._run

    def adaptive(self, target, drafter, config):
        engine(self, target, drafter, replace(config, adaptive=True))
        self.policy = policy()

    Engine.__init__ = adaptive
    if stream is not None:
        Engine._run = _in_order(stream, run)
    try:
        yield
    finally:
        Engine.__init__, Engine._run = engine, run
        if stream is not None:
            stream.close()


def _policy_run(target, overlap: bool, drafter: str, arrival: bool = False, seen=None):
    """The scenario (a long request more, no arrival) under the scripted policy -> (the engine, its requests, the
    stand-in stream or None). arrival: the `runs` fixture's scenario instead (LATE arrives), every choice the
    configured tree (each request drafts as without the policy); seen: as _scenario's."""
    stream = QueuedStream() if overlap else None
    with scripted_policy(stream, (lambda: _Scripted(set(), set())) if arrival else _Scripted):
        extra = () if arrival else [LONG]
        return (*_scenario(target, overlap, stream, drafter, extra, late=arrival, seen=seen), stream)


@pytest.fixture(scope="module", params=["eagle3", "moa"])
def policy_runs(smollm2_fp32, request):
    """Per drafter, the policy's scenario without overlap and with it (a stand-in stream)."""
    return {name: _policy_run(smollm2_fp32, name == "overlap", request.param) for name in ("plain", "overlap")}


def test_under_the_policy_chained_outputs_equal_the_plain_loop(policy_runs):
    """Under the same scripted decisions (off and on the smaller tree in between), as the plain loop: tokens, finish
    reasons, verify steps, drafts and acceptance (a chain continued on another tree, its drafter's commit cut to
    that tree's rows, accepts less), the prefix cache's tokens, what the drafter keeps; no slot of the target's or
    the drafter's pools leaked. (No arrival: a request joining mid-run joins the overlapped loop's batch a step
    later, its first chained Engine.step issuing two steps, so decisions by step would fall on other batches; see
    test_under_the_policy_an_arrival_while_a_chain_is_in_flight_joins_the_chains.)"""
    eng, reqs, _ = policy_runs["overlap"]
    assert _summary(eng, reqs) == _summary(*policy_runs["plain"][:2])
    assert {o for o, *_ in eng.policy.seen} == {0, 1, 2}


def test_under_the_policy_drafted_steps_chain(policy_runs):
    """Step N+1 issued before step N is read, in several chains (each ended by the policy's other option)."""
    stream = policy_runs["overlap"][2]
    ahead, behind = _order(stream)
    assert len(ahead) >= 4 and behind, (ahead, behind)
    assert len([n for n in ahead if n - 1 not in ahead]) >= 2, ahead  # (chains started)
    policy = policy_runs["overlap"][0].policy
    chained = [o for o, (c, _) in zip(policy.seen, policy.kinds) if c]
    assert {o for o, *_ in chained} == {1, 2}, chained  # (both trees chained, never 'off')
    assert all(not unrated for c, unrated in policy.kinds if c)  # (a catch-up step is an ordinary one)
    assert any(unrated for _, unrated in policy.kinds)
    assert policy.calls - policy_runs["plain"][0].policy.calls in (0, 1)  # (one choice a step: the surplus one)
    for n in ahead:
        between = stream.log[stream.log.index(("copy", n)) + 1 : stream.log.index(("read", n))]
        assert between.count(("replay", None)) == 2 and ("copy", n + 1) in between


@pytest.mark.parametrize("name", ["plain", "overlap"])
def test_under_the_policy_each_step_is_observed_once(policy_runs, name):
    """Every request's every decode step observed once with its real tokens, acceptance and drafts: the sums equal
    the requests' own counts (all tokens but each request's first, its prefill's); overlapped, every observation
    but the seconds is the plain loop's."""
    eng, reqs, _ = policy_runs[name]
    seen = eng.policy.seen
    assert sum(len(acc) for *_, acc, _ in seen) == sum(r.stats.verify_steps for r in reqs)
    assert sum(t for _, _, t, *_ in seen) == sum(len(r.output_ids) - 1 for r in reqs)
    assert sum(sum(acc) for *_, acc, _ in seen) == sum(r.stats.accepted_tokens for r in reqs) > 0
    assert sum(sum(d) for *_, d in seen) == sum(r.stats.draft_tokens for r in reqs)
    assert all(n == len(acc) and rows >= n for _, n, _, rows, acc, _ in seen)
    assert seen == policy_runs["plain"][0].policy.seen  # (the same steps, batches, rows and outcomes, in order)


def test_under_the_policy_an_arrival_while_a_chain_is_in_flight_joins_the_chains(smollm2_fp32, runs):
    """Under the policy (its every choice the configured tree: each request drafts as without it), LATE arrives
    while a chain is in flight, then joins the chains after its prefill. As the plain loop without the policy:
    tokens, finish reasons, drafts and acceptance, the prefix cache's tokens, what the drafter keeps; no slot
    leaked; every request's every decode step observed once."""
    seen = {}
    with _recorded(seen):
        eng, reqs, _ = _policy_run(smollm2_fp32, True, runs["plain"][0].drafter.name, arrival=True, seen=seen)
    _joins_the_chains(seen, reqs)
    assert _summary(eng, reqs) == _summary(*runs["plain"][:2])
    observed = eng.policy.seen
    assert sum(len(acc) for *_, acc, _ in observed) == sum(r.stats.verify_steps for r in reqs)
    assert sum(sum(acc) for *_, acc, _ in observed) == sum(r.stats.accepted_tokens for r in reqs) > 0
    assert any(c for c, _ in eng.policy.kinds)  # (chained steps observed)


def test_under_the_policy_a_faulty_drafter_mid_chain_falls_back_once(smollm2_fp32, runs, faulty_plain):
    """test_a_faulty_drafter_mid_chain_falls_back_once under the policy (its every choice the configured tree; its
    first drafted step an ordinary one): FAULTY's poisoned tree in a chain's first step is read while the second,
    its poisoned tree in it too, is in flight; FAULTY falls back once, its work in the second step dropped unread,
    the others' chains go on with FAULTY as a root-only row; as the plain loop with the same fault (under such a
    policy the same steps as without it), every output vanilla's greedy, every pool whole; every request's every
    decode step observed once."""
    run = _faulty_run(smollm2_fp32, True, runs["plain"][0].drafter.name, policy=True)
    _falls_back_once(run, faulty_plain, runs["plain"][1][:4], list(POISONED))
    eng, reqs, _, seen, _ = run
    launches = seen["launches"]
    assert not launches[0][0] and launches[1][0], launches
    _rides_the_chains(seen, 2)
    observed = eng.policy.seen
    assert sum(len(acc) for *_, acc, _ in observed) == sum(r.stats.verify_steps for r in reqs)
    assert sum(sum(acc) for *_, acc, _ in observed) == sum(r.stats.accepted_tokens for r in reqs) > 0
    assert any(c for c, _ in eng.policy.kinds)
