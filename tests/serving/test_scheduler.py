"""serving/scheduler.py alone (no model): the waiting queue's interface, chunked prefill within the budget, and
each step's batches with and without mixed prefill."""

from __future__ import annotations

from serving.request import Request
from serving.scheduler import Scheduler, WaitingQueue
from sglang_ext.sampling import SamplingParams


def _req(rid: int, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_new_tokens=4), None)


def test_waiting_queue_serves_in_order_and_removes_anywhere():
    q: WaitingQueue[str] = WaitingQueue()
    for item in ("aa", "b", "cccc", "dd"):
        q.push(item)
    assert len(q) == 4 and list(q) == ["aa", "b", "cccc", "dd"] and "b" in q
    assert q.remove("b") and not q.remove("b") and "b" not in q
    assert q.pop_next() == "aa" and q.pop_next() == "cccc"
    assert q.clear() == ["dd"] and not q


def test_prompts_are_prefilled_in_chunks_within_the_budget():
    s = Scheduler(prefill_tokens=8)
    a, b, c = _req(0, 5), _req(1, 6), _req(2, 3)
    for r in (a, b, c):
        s.add(r)
    looked_up = []
    ((decoding, chunks),) = s.schedule(looked_up.append)
    assert decoding == [] and chunks == [(a, 5), (b, 3)]  # 5 + 3 tokens: b is split, c waits
    assert looked_up == [a, b] and list(s.waiting) == [b, c] and s.in_step == [a, b]
    b.prefilled = 3
    s.start_decoding(a)
    ((decoding, chunks),) = s.schedule(looked_up.append)
    assert decoding == [a] and chunks == [(b, 6), (c, 3)] and not s.waiting
    assert looked_up == [a, b, c]  # b's prefill had started: not looked up again


def test_without_mixed_prefill_the_chunks_get_a_forward_of_their_own():
    s = Scheduler(prefill_tokens=64, mixed_prefill=False)
    a, b = _req(0, 4), _req(1, 4)
    s.add(a)
    s.schedule(lambda r: None)
    s.start_decoding(a)
    s.add(b)
    assert s.schedule(lambda r: None) == [([], [(b, 4)]), ([a], [])]
    assert s.held() == [a, b]  # b: taken from waiting by this step
    assert s.remove(a) and not s.remove(b)
    s.end_step()
    assert s.held() == [] and not s.has_work


def test_an_object_that_is_not_a_drafter_is_refused_by_name():
    import pytest
    from helpers import tiny_target

    from serving.engine import Engine

    class DuckDrafter:  # every lifecycle call, but not the Drafter type (whose capabilities the engine reads)
        name, capture_layers = "duck", ()

    with pytest.raises(TypeError, match="DuckDrafter is not a drafter: subclass sglang_ext.drafters.Drafter"):
        Engine(tiny_target(), DuckDrafter())
