"""The overlapped loop (serving/decode_step.py): step N+1's launches are issued before step N's tokens are read,
each step's tokens come up in one device-to-host copy, and every request's output is the loop without overlap's.

On the CPU the device is `helpers.QueuedStream`: the graph runner's work (fills, table writes, replays, copies)
is queued and run in order by a worker thread only once the host waits for it, so a host read that does not go
through the step's copy sees stale values and the outputs differ. The real SmolLM2 target
(fp32) decodes short chat prompts with different lengths and stops: max_tokens, EOS, a stop id, an abort
mid-batch and an arrival mid-batch (its prefill issued beside the step in flight, before that step is read: more
arrival patterns in test_engine_overlap_arrivals.py), through Engine.step and through the engine loop's thread.
The `gpu` cases run the same scenario on CUDA's stream with captured graphs.
"""

from __future__ import annotations

import asyncio

import pytest
from helpers import (
    QueuedStream,
    copies_read_after_the_next,
    log_cuda_copies,
    prefill_copies,
    prefills_in_flight,
    slots_whole,
    step_order,
)

from serving.config import EngineConfig
from serving.engine import Engine
from sglang_ext.models.graph_runner import GraphRunner
from sglang_ext.sampling import SamplingParams

PERIOD = 30  # SmolLM2's "." (a stop id)
# (prompt, params): ends by its length, by EOS, by a stop id, aborted (ABORT_AFTER steps) before its length
REQUESTS = [
    ("Name three rivers.", SamplingParams(max_new_tokens=5)),
    ("Hi!", SamplingParams(max_new_tokens=16)),
    ("Say OK.", SamplingParams(max_new_tokens=16, stop_token_ids=[PERIOD])),
    ("What is 7*8?", SamplingParams(max_new_tokens=12)),
]
LATE = ("Reply with one word: yes or no?", SamplingParams(max_new_tokens=8))  # arrives after ARRIVE_AFTER steps
ARRIVE_AFTER, ABORT_AFTER = 3, 6  # engine steps


def _scenario(target, overlap: bool, stream=None):
    """The requests above through Engine.step -> (the engine, its requests). prefill "separate": every decode
    token of both loops comes from the graph (on the CPU an eager mixed forward rounds differently from it)."""
    eng = Engine(target, None, EngineConfig(overlap=overlap, prefill="separate", kv_slots=2048))
    if stream is not None:  # (the CPU: the graph runner on the stand-in stream; CUDA: its own)
        eng.runner.graph_runner = GraphRunner(eng.model, eng.capture_layers, stream=stream)
    assert eng.runner.graph_runner is not None and eng.runner.stream.asynchronous
    encode = lambda text: target.encode_chat([{"role": "user", "content": text}])  # noqa: E731
    reqs = [eng.add_request(encode(t), p) for t, p in REQUESTS]
    steps = 0
    while eng.has_work:
        eng.step()
        steps += 1
        if steps == ARRIVE_AFTER:
            reqs.append(eng.add_request(encode(LATE[0]), LATE[1]))
        if steps == ABORT_AFTER:
            eng.abort(reqs[3])
        assert steps < 60
    return eng, reqs


def _summary(eng: Engine, reqs) -> list:
    assert slots_whole(eng), "KV slots leaked"
    return [(r.output_ids, r.finish_reason, r.stats.verify_steps) for r in reqs] + [eng.prefix_cache.tokens]


@pytest.fixture(scope="module")
def runs(smollm2_fp32):
    """The scenario without overlap and with it, each on a stand-in stream of its own."""
    out = {}
    for name, overlap in (("plain", False), ("overlap", True)):
        stream = QueuedStream()
        try:
            eng, reqs = _scenario(smollm2_fp32, overlap, stream)
        finally:
            stream.close()
        out[name] = (eng, reqs, stream)
    return out


def test_the_scenario_ends_requests_every_way(runs):
    _, reqs, _ = runs["plain"]
    assert [r.finish_reason for r in reqs] == ["length", "stop", "stop", "abort", "stop"]
    assert reqs[2].output_ids[-1] == PERIOD and 3 < len(reqs[2].output_ids) < 16  # stopped at its stop id
    assert len(reqs[3].output_ids) == ABORT_AFTER  # (a token per step: the prefill's, then one per decode step)


def test_overlapped_outputs_equal_the_plain_loop(runs):
    """Token for token, finish reasons, verify steps, the prefix cache's tokens, no slot leaked."""
    eng, reqs, _ = runs["overlap"]
    assert _summary(eng, reqs) == _summary(*runs["plain"][:2])
    assert eng.overlap.inflight is not None  # (the last step, all its tokens surplus, was issued and never read)


def test_step_n_plus_1_is_issued_before_step_n_is_read(runs):
    """Overlapped: every decode step is read after the next one's replay and copy were issued, the arrival's too
    (arrivals end no chain: its prefill was issued while the step in flight was not read yet, and it decodes in the
    chain from the step after). Without overlap every step is read before the next is issued."""
    stream = runs["overlap"][2]
    ahead, behind = step_order(stream.log)
    assert behind == [] and len(ahead) >= 8, (ahead, behind)
    assert [read for _, read in prefills_in_flight(stream.log)] == [False]  # (the arrival's prefill, step in flight)
    i = stream.log.index(("read", ahead[0]))
    assert ("replay", None) in stream.log[stream.log.index(("copy", ahead[0])) + 1 : i]  # step N+1's replay
    assert step_order(runs["plain"][2].log)[0] == []


@pytest.mark.parametrize("name", ["plain", "overlap"])
def test_one_device_to_host_copy_per_step(runs, name):
    """A copy per replayed decode step (and per arrivals' prefill issued beside one), each read once at most;
    overlapped, only the last (surplus) is never read."""
    eng, _, stream = runs[name]
    reads, prefills = [i for kind, i in stream.log if kind == "read"], prefill_copies(stream.log)
    assert stream.copies - len(prefills) == eng.runner.graph_runner.runs == stream.log.count(("replay", None)) > 0
    assert sorted(reads) == list(range(1, stream.copies + 1 - (name == "overlap")))
    assert len(prefills) == (name == "overlap")  # (without overlap the arrival's prefill is the ordinary step's)


def test_overlap_is_off_on_a_synchronous_device(smollm2_fp32):
    """The CPU's engine (no graph runner; `make serve`'s q8 path) and a graph runner on a synchronous stream take
    no overlapped step."""
    eng = Engine(smollm2_fp32, None, EngineConfig())
    assert eng.config.overlap and eng.runner.stream is None and not eng.overlap.applies()
    eng.runner.graph_runner = GraphRunner(eng.model, eng.capture_layers)
    assert not eng.runner.stream.asynchronous and not eng.overlap.applies()


# --- on CUDA: the same scenario on the device's stream, graphs captured ---------------------------------------


@pytest.mark.gpu
def test_gpu_overlapped_outputs_equal_the_plain_loop(smollm2_cuda):
    plain = _scenario(smollm2_cuda, False)
    eng, reqs = _scenario(smollm2_cuda, True)
    assert eng.runner.graph_runner.graphs and eng.runner.stream.copies == eng.runner.graph_runner.runs
    assert _summary(eng, reqs) == _summary(*plain)


@pytest.mark.gpu
def test_gpu_step_n_plus_1_is_issued_before_step_n_is_read(smollm2_cuda, monkeypatch):
    """The order on CUDA's stream: the copies issued and the waits for them, logged."""
    log = log_cuda_copies(monkeypatch)
    _scenario(smollm2_cuda, True)
    reads, ahead = copies_read_after_the_next(log)  # (the arrival's prefill's copy read after step N+1's was issued)
    assert len(ahead) >= 8 and len(reads) == len(ahead), log


def _served(target, overlap: bool) -> list[tuple[list[int], str | None]]:
    """The requests above through the engine loop (its thread, deliveries, a cancel): the first submitted, the
    rest and the late one from the engine thread between steps (so each step's batch is the same in every run),
    the cancel there too, once the fourth has ABORT_AFTER tokens -> per request, its delivered tokens and finish
    reason."""
    from serving.engine_loop import EngineLoop

    eng = Engine(target, None, EngineConfig(overlap=overlap, prefill="separate", kv_slots=2048))
    stream = QueuedStream()
    eng.runner.graph_runner = GraphRunner(eng.model, eng.capture_layers, stream=stream)
    encode = lambda text: target.encode_chat([{"role": "user", "content": text}])  # noqa: E731
    engine_loop, handles, real_step, steps = EngineLoop(eng, max_running=8, max_queue=8), [], eng.step, [0]
    submit = lambda text, params: handles.append(engine_loop.submit(encode(text), params, asyncio_loop))  # noqa: E731

    def step():
        events = real_step()
        steps[0] += 1
        if steps[0] == 1:
            for text, params in REQUESTS[1:]:
                submit(text, params)
        if steps[0] == ARRIVE_AFTER + 1:
            submit(*LATE)
        aborted = [r for r in eng.running if r.prompt_ids == encode(REQUESTS[3][0])]
        if aborted and len(aborted[0].output_ids) >= ABORT_AFTER and not handles[3].done:
            handles[3].cancel()  # (by its tokens: a request that arrived while a chain ran joins it a step later)
        return events

    async def run():
        nonlocal asyncio_loop
        asyncio_loop = asyncio.get_running_loop()
        submit(*REQUESTS[0])
        while not (len(handles) == len(REQUESTS) + 1 and all(h.done for h in handles)):
            await asyncio.sleep(0.01)
        return [await _collect(h) for h in handles]

    eng.step, asyncio_loop = step, None
    engine_loop.start()
    try:
        return asyncio.run(asyncio.wait_for(run(), 120))
    finally:
        engine_loop.stop()
        stream.close()
        assert slots_whole(eng)


async def _collect(h) -> tuple[list[int], str | None]:
    tokens = []
    while True:
        d = await h.next()
        tokens += d.tokens
        if d.finish_reason or d.error:
            return tokens, d.finish_reason


def test_the_engine_loop_delivers_what_the_plain_loop_does(smollm2_fp32):
    """Through the engine thread: the same tokens delivered to each request, and the same finish reasons."""
    plain, overlapped = _served(smollm2_fp32, False), _served(smollm2_fp32, True)
    assert [f for _, f in plain] == ["length", "stop", "stop", "abort", "stop"]
    assert overlapped == plain
