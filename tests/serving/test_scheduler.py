"""serving/scheduler.py alone (no model): the waiting queue's interface, chunked prefill within the budget, and
each step's batches in each prefill mode."""

from __future__ import annotations

from serving.request import Request
from serving.scheduler import Scheduler, WaitingQueue
from sglang_ext.sampling import SamplingParams


def _req(rid: int, n: int, share: str = "") -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_new_tokens=4), None, share=share)


def test_waiting_queue_serves_in_order_and_removes_anywhere():
    q: WaitingQueue[str] = WaitingQueue()
    for item in ("aa", "b", "cccc", "dd"):
        q.push(item)
    assert len(q) == 4 and list(q) == ["aa", "b", "cccc", "dd"] and "b" in q
    assert q.remove("b") and not q.remove("b") and "b" not in q
    assert q.pop_next() == "aa" and q.pop_next() == "cccc"
    assert q.clear() == ["dd"] and not q


def test_prompts_are_prefilled_in_chunks_within_the_budget():
    s = Scheduler(prefill_tokens=8, prefill="mixed")
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


def test_prefill_separate_gives_the_chunks_a_forward_of_their_own_in_the_same_step():
    s = Scheduler(prefill_tokens=64, prefill="separate")
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


def test_prefill_first_gives_a_newcomer_a_step_of_its_own_one_step_in_two_at_most():
    s = Scheduler(prefill_tokens=4)  # the default: "first"
    a = _req(0, 4, "A")
    s.add(a)
    assert s.schedule(lambda r: None) == [([], [(a, 4)])]  # nothing decoding: a plain prefill step
    s.start_decoding(a)
    a2, b, c = _req(1, 2, "A"), _req(2, 3, "B"), _req(3, 6, "C")
    for r in (a2, b, c):
        s.add(r)
    # B and C have nothing running: their prompts get a step of their own (A's decoding waits for it), ahead
    # of A's second request, which waits for the next step
    assert s.schedule(lambda r: None) == [([], [(b, 3), (c, 1)])] and list(s.waiting) == [a2, c]
    c.prefilled = 1
    s.start_decoding(b)
    # the next step decodes, the prompts beside it (C's rest within the budget): never two held-back steps in a row
    assert s.schedule(lambda r: None) == [([a, b], [(a2, 2), (c, 3)])]
    c.prefilled = 3
    s.start_decoding(a2)
    assert s.schedule(lambda r: None) == [([], [(c, 6)])]  # C is still a newcomer
    s.start_decoding(c)
    a3 = _req(4, 2, "A")
    s.add(a3)
    assert s.schedule(lambda r: None) == [([a, b, a2, c], [(a3, 2)])]  # A has requests running: mixed
    s.clear()
    assert not s.has_work and s.schedule(lambda r: None) == []


def test_prefill_first_with_one_tenant_is_mixed():
    s, m = Scheduler(prefill_tokens=8), Scheduler(prefill_tokens=8, prefill="mixed")
    for sched in (s, m):
        reqs = [_req(i, 3 + i) for i in range(4)]
        sched.add(reqs[0])
        batches = [sched.schedule(lambda r: None)]
        sched.start_decoding(reqs[0])
        for r in reqs[1:]:
            sched.add(r)
            batches.append(sched.schedule(lambda r: None))
            for _, chunks in batches[-1]:
                for q, end in chunks:
                    q.prefilled = end
                    if end == len(q.prompt_ids):
                        sched.start_decoding(q)
        sched.batches = [[([q.rid for q in d], [(q.rid, e) for q, e in c]) for d, c in b] for b in batches]
    assert s.batches == m.batches and s.batches[1] == [([0], [(1, 4)])]


def test_an_unknown_prefill_mode_is_refused():
    import pytest

    from serving.config import EngineConfig

    with pytest.raises(ValueError, match="prefill must be one of first, mixed, separate, got 'eager'"):
        Scheduler(prefill_tokens=4, prefill="eager")
    with pytest.raises(ValueError, match="prefill must be one of first, mixed, separate"):
        EngineConfig(prefill="eager")


def test_an_object_that_is_not_a_drafter_is_refused_by_name():
    import pytest
    from helpers import tiny_target

    from serving.engine import Engine

    class DuckDrafter:  # every lifecycle call, but not the Drafter type (whose capabilities the engine reads)
        name, capture_layers = "duck", ()

    with pytest.raises(TypeError, match="DuckDrafter is not a drafter: subclass sglang_ext.drafters.Drafter"):
        Engine(tiny_target(), DuckDrafter())
