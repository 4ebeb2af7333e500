"""serving/tenancy.py alone: the keys file's tenants, the fair queue and its asyncio gate (no engine, no server)."""

import asyncio
import logging

import pytest

from serving.tenancy import (
    AsyncAdmission,
    FairQueue,
    Refused,
    Tenant,
    TenantsFileError,
    parse_keys,
)

A, B, C = Tenant("a"), Tenant("b"), Tenant("c")


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    def __init__(self):
        self.events = []

    def admitted(self, tenant, waited_s):
        self.events.append(("admitted", tenant, round(waited_s, 6)))

    def refused(self, tenant, reason):
        self.events.append(("refused", tenant, reason))

    def finished(self, tenant, prompt, completion):
        self.events.append(("finished", tenant, prompt, completion))


def drain(q: FairQueue, max_running: int, done_each: bool = True) -> list[str]:
    """Admit everything one at a time (each admitted request ends before the next is chosen when done_each)."""
    order = []
    while (item := q.peek(max_running)) is not None:
        q.pop(item)
        order.append(item)
        if done_each:
            q.done(item)
    return order


def test_plain_keys_are_each_their_own_tenant_of_weight_one():
    got = parse_keys(["# comment", "", "  sk-one  ", "sk-two==  # a comment", "#sk-not-a-key"], "keys")
    assert got == [("sk-one", Tenant("key1")), ("sk-two==", Tenant("key2"))]  # a key may hold '=' (base64)


def test_named_tenants_share_fields_given_on_any_line():
    got = dict(
        parse_keys(
            [
                "k1 tenant=team-a weight=2 max_running=8",
                "k2 tenant=team-a tokens_per_minute=1000",
                "k3 tenant=batch weight=0.5 max_queued=0",
                "k4",
            ],
            "keys",
        )
    )
    team_a = Tenant("team-a", weight=2.0, max_running=8, tokens_per_minute=1000)
    assert got == {"k1": team_a, "k2": team_a, "k3": Tenant("batch", 0.5, max_queued=0), "k4": Tenant("key4")}


@pytest.mark.parametrize(
    "lines,message",
    [
        (["k1", "k1 tenant=x"], "keys line 2: the same key as line 1"),
        (["k1 weight=0"], "keys line 1: weight must be a number > 0, got '0'"),
        (["k1 weight=nan"], "weight must be a number > 0"),
        (["k1 max_running=two"], "max_running must be a whole number >= 1, got 'two'"),
        (["k1 max_queued=-1"], "max_queued must be a whole number >= 0"),
        (["k1 wieght=2"], "unknown field 'wieght'"),
        (["k1 team-a"], "keys line 1: word 2 is not name=value"),
        (["k1 k2"], "word 2 is not name=value"),  # two keys on a line: neither in the message
        (["k1 Zk2/x==", "k2"], "unknown field word 2"),  # a key holding '=' after a space
        (["k1 weight=1 weight=2"], "'weight' is given twice"),
        (["k1 tenant=a b"], "word 3 is not name=value"),
        (['k1 tenant=has"quote'], "tenant name 'has\"quote' must be"),
        (
            ["k1 tenant=t weight=1", "k2 tenant=t weight=2"],
            "line 2: tenant 't' has weight=2.0 here and weight=1.0 on line 1",
        ),
        (["k1", "k2 tenant=key1"], "line 2: tenant name 'key1' is also the name of the unnamed key on line 1"),
        (["k1 tenant=key2", "k2"], "line 2: tenant name 'key2' is also the name of the unnamed key on line 2"),
    ],
)
def test_bad_lines_name_the_line_and_never_the_key(lines, message):
    with pytest.raises(TenantsFileError) as e:
        parse_keys(lines, "keys")
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not {"k1", "k2", "Zk2"} & set(str(e.value).replace("'", " ").split())


def test_one_tenant_is_first_in_first_out_with_the_same_limits_as_one_queue():
    q = FairQueue()
    for i in range(4):
        assert q.push(f"a{i}", A, 10, limit=4) == []
    with pytest.raises(Refused) as e:
        q.push("a4", A, 10, limit=4)
    assert e.value.reason == "queue" and e.value.retry_after >= 1 and "4 requests queued" in str(e.value)
    assert drain(q, max_running=1) == ["a0", "a1", "a2", "a3"]


def test_equal_tenants_alternate_by_tokens():
    q = FairQueue()
    for i in range(4):
        q.push(f"a{i}", A, 10, limit=100)
    for i in range(2):
        q.push(f"b{i}", B, 20, limit=100)  # twice the tokens: half as many admissions
    assert drain(q, max_running=1) == ["a0", "b0", "a1", "a2", "b1", "a3"]


def test_weights_divide_the_service():
    heavy = Tenant("heavy", weight=3)
    q = FairQueue()
    for i in range(8):
        q.push(f"h{i}", heavy, 10, limit=100)
        q.push(f"b{i}", B, 10, limit=100)
    first8 = drain(q, max_running=1)[:8]
    assert sum(x.startswith("h") for x in first8) == 6  # 3 : 1


def test_a_newcomer_goes_before_every_request_queued_when_it_arrived():
    """Start-time fair queueing: B's virtual start is the virtual time now, below every queued A request's."""
    q = FairQueue()
    for i in range(6):
        q.push(f"a{i}", A, 10, limit=100)
    q.pop(q.peek(1))  # a0 runs (A's next starts after it)
    q.push("b0", B, 10, limit=100)
    assert q.peek(1) is None  # the one slot is taken
    q.done("a0")
    assert q.peek(1) == "b0"
    q.pop("b0")
    q.done("b0")
    q.pop(q.peek(1))  # a1
    q.done("a1")
    q.push("b1", B, 10, limit=100)  # B again, having had one while A had two
    assert q.peek(1) == "b1"


def test_a_tie_goes_to_the_tenant_running_fewer():
    q = FairQueue()
    for i in range(3):
        q.push(f"a{i}", A, 10, limit=100)
    q.pop(q.peek(4))  # a0 running
    q.push("b0", B, 10, limit=100)
    q.pop(q.peek(4))  # b0 (the newcomer)
    q.done("b0")
    q.push("b1", B, 10, limit=100)  # B's start = its finish = A's next start; B runs none, A runs one
    assert q.peek(4) == "b1"


def test_a_full_queue_pushes_out_the_tenant_with_the_longest_queue_for_its_weight():
    rec = Recorder()
    q = FairQueue(rec)
    for i in range(4):
        q.push(f"a{i}", A, 10, limit=4)
    assert q.push("b0", B, 10, limit=4) == ["a3"]  # B had none: A's newest goes
    assert q.push("b1", B, 10, limit=4) == ["a2"]  # 2 vs 3
    with pytest.raises(Refused):  # B would have 3 against A's 2: B is the one over its share
        q.push("b2", B, 10, limit=4)
    with pytest.raises(Refused) as e:  # and A, at its share, cannot push B out either
        q.push("a4", A, 10, limit=4)
    assert "its share" in str(e.value)
    assert sorted(q) == ["a0", "a1", "b0", "b1"]
    assert [e for e in rec.events if e[0] == "refused"] == [
        ("refused", "a", "queue"),
        ("refused", "a", "queue"),
        ("refused", "b", "queue"),
        ("refused", "a", "queue"),
    ]
    heavy = Tenant("c", weight=4)  # weight 4: C may queue 4x what A queues before it is the longest
    assert q.push("c0", heavy, 10, limit=4) == ["a1"] and q.push("c1", heavy, 10, limit=4) == ["b1"]
    assert q.push("c2", heavy, 10, limit=4) == ["a0"]


def test_per_tenant_limits():
    capped = Tenant("capped", max_running=1, max_queued=2)
    q = FairQueue()
    q.push("c0", capped, 10, limit=100)
    q.push("c1", capped, 10, limit=100)
    with pytest.raises(Refused) as e:
        q.push("c2", capped, 10, limit=100)
    assert e.value.reason == "queue" and "its limit" in str(e.value)
    q.push("b0", B, 10, limit=100)
    assert drain(q, max_running=8, done_each=False) == ["c0", "b0"]  # c1 waits: its tenant runs its 1
    q.done("c0")
    assert q.peek(8) == "c1"


def test_guaranteed_share_admits_a_newcomer_past_a_full_batch():
    q = FairQueue()
    for i in range(8):
        q.push(f"a{i}", A, 10, limit=100)
    assert drain(q, max_running=4, done_each=False) == ["a0", "a1", "a2", "a3"]
    q.push("b0", B, 10, limit=100)
    q.push("b1", B, 10, limit=100)
    q.push("b2", B, 10, limit=100)
    # 4 run, all A's; B's share of 4 is 2: two of B's are admitted at once, then nobody until the batch shrinks
    assert drain(q, max_running=4, done_each=False) == ["b0", "b1"]
    assert q.running == 6
    for a in ("a0", "a1", "a2"):
        q.done(a)
    assert q.running == 3 and q.peek(4) == "a4"  # under 4 again: by virtual time (B ran ahead on its share)
    q.pop("a4")
    assert q.peek(4) is None  # 4 run, A and B at their share of 2
    q.done("a3")
    assert q.peek(4) == "a5"  # A and B tie at the same virtual time: the tenant running fewer (A 1, B 2)


def test_guaranteed_shares_never_run_more_than_twice_max_running():
    """Tenants arriving one after another each get their share of a full batch at the time; however the shares
    change, no more than 2 x max_running run."""
    q = FairQueue()
    names = [Tenant(f"t{i}", weight=100.0 if i else 1.0) for i in range(6)]
    for i in range(4):
        q.push(f"t0-{i}", names[0], 10, limit=100)
    drain(q, max_running=4, done_each=False)
    for t in names[1:]:
        for i in range(4):
            q.push(f"{t.name}-{i}", t, 10, limit=100)
        drain(q, max_running=4, done_each=False)
        assert q.running <= 8
    assert q.running == 8


def test_guaranteed_share_of_a_lone_tenant_is_the_whole_batch():
    q = FairQueue()
    for i in range(6):
        q.push(f"a{i}", A, 10, limit=100)
    assert drain(q, max_running=4, done_each=False) == ["a0", "a1", "a2", "a3"] and q.running == 4


def test_tokens_per_minute():
    clock = Clock()
    rec = Recorder()
    metered = Tenant("m", tokens_per_minute=100)
    q = FairQueue(rec, clock)
    q.push("m0", metered, 60, limit=100)
    with pytest.raises(Refused) as e:
        q.push("m1", metered, 50, limit=100)
    assert e.value.reason == "tokens_per_minute" and e.value.retry_after == 60 and "60 of its 100" in str(e.value)
    clock.now += 20
    q.pop(q.peek(4))
    q.done("m0", prompt_tokens=5, completion_tokens=15)  # used 20 of the 60 it was charged
    q.push("m1", metered, 50, limit=100)  # 20 + 50 <= 100
    with pytest.raises(Refused) as e:
        q.push("m2", metered, 40, limit=100)
    assert e.value.retry_after == 40  # m0's 20 leave the minute 60 s after it was queued
    q.remove("m1")  # a request that leaves the queue used nothing
    q.push("m2", metered, 40, limit=100)
    with pytest.raises(Refused) as e:
        q.push("big", metered, 101, limit=100)
    assert e.value.reason == "too_large" and "lower max_tokens" in str(e.value)
    clock.now += 59
    q.push("m3", metered, 100 - 40, limit=100)  # m0 left the minute; m2's 40 remain
    assert ("finished", "m", 5, 15) in rec.events
    assert [e[2] for e in rec.events if e[0] == "refused"] == ["tokens_per_minute", "tokens_per_minute", "too_large"]


def test_settling_to_used_tokens_moves_virtual_time_back():
    q = FairQueue()
    q.push("a0", A, 1000, limit=100)  # A reserved 1000 tokens and used 10
    q.pop("a0")
    q.done("a0", prompt_tokens=5, completion_tokens=5)
    q.push("a1", A, 10, limit=100)
    q.push("b0", B, 10, limit=100)
    q.push("b1", B, 10, limit=100)
    assert drain(q, 1) == ["b0", "a1", "b1"]  # charged its 1000, a1 would wait behind both of B's


def test_remove_clear_counts_and_forgetting_idle_tenants():
    q = FairQueue()
    q.push("a0", A, 10, limit=100)
    q.push("a1", A, 10, limit=100)
    q.push("b0", B, 10, limit=100)
    assert len(q) == 3 and "a1" in q and q.counts("a") == (0, 2)
    assert q.remove("a1") and not q.remove("a1") and "a1" not in q
    q.pop(q.peek(4))
    assert q.counts("a") == (1, 0) and q.running == 1
    assert sorted(q.clear()) == ["b0"] and len(q) == 0
    q.done("a0")
    q.done("never-admitted")  # a no-op
    assert q.counts("a") == (0, 0) and len(q._tenants) <= 2
    q.push("c0", C, 10, limit=100)
    q.push("c1", C, 10, limit=100)
    with pytest.raises(ValueError):
        q.pop("c1")  # not its tenant's head


def test_retry_after_from_recent_completions():
    clock = Clock()
    q = FairQueue(clock=clock)
    assert q.retry_after() == 1
    for i in range(10):
        q.push(f"a{i}", A, 10, limit=100)
    for i in range(4):
        q.pop(f"a{i}")
        clock.now += 1.0
        q.done(f"a{i}")
    assert q.retry_after() == 5  # 6 queued; 4 completions in the 3 s since the first: ceil(6 / (4 / 3))


def test_admission_events_are_logged_with_names_and_order(caplog):
    q = FairQueue()
    with caplog.at_level(logging.DEBUG, logger="serving.tenancy"):
        q.push("a0", A, 10, limit=2)
        q.push("a1", A, 10, limit=2)
        q.push("b0", B, 10, limit=2)
        with pytest.raises(Refused):
            q.push("b1", B, 10, limit=2)
        q.pop(q.peek(1))
    events = [r.admission for r in caplog.records]
    assert events == [
        ("queued", "a", 1),
        ("queued", "a", 2),
        ("pushed out", "a", 2),
        ("queued", "b", 3),
        ("refused", "b", 0),
        ("admitted", "a", 1),
    ]


def test_async_admission_gates_the_slots_fairly():
    async def run():
        gate = AsyncAdmission(max_running=1, max_queue=2)
        order = []

        async def user(name, tenant):
            try:
                ticket = await gate.enter(tenant, 10)
            except Refused as e:
                order.append(f"{name}:429:{e.retry_after}")
                return
            order.append(name)
            await asyncio.sleep(0)
            gate.leave(ticket, 1, 1)

        first = await gate.enter(A, 10)  # holds the one slot
        tasks = [asyncio.create_task(user(f"a{i}", A)) for i in range(3)]
        await asyncio.sleep(0)
        assert gate.load() == (1, 2)  # a2 refused: the queue holds 2
        tasks.append(asyncio.create_task(user("b0", B)))  # pushes a1 out
        await asyncio.sleep(0)
        gate.leave(first)
        await asyncio.gather(*tasks)
        assert gate.load() == (0, 0)
        return order

    order = asyncio.run(run())
    assert order[0] == "a2:429:1" and order[1] == "a1:429:1"  # a2 refused; a1 pushed out by b0
    assert order[2:] == ["b0", "a0"]


def test_async_admission_cancelled_and_aborted_waiters():
    async def run():
        gate = AsyncAdmission(max_running=1, max_queue=2)
        first = await gate.enter(A, 10)
        queued = asyncio.create_task(gate.enter(B, 10))
        await asyncio.sleep(0)
        assert gate.load() == (1, 1)
        queued.cancel()  # its client left while it waited
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert gate.load() == (1, 0)
        waiter = asyncio.create_task(gate.enter(B, 10))
        await asyncio.sleep(0)
        gate.leave(first)  # admits the waiter...
        waiter.cancel()  # ...whose task is cancelled before it resumes: the slot comes back
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert gate.load() == (0, 0)
        first = await gate.enter(A, 10)
        waiter = asyncio.create_task(gate.enter(B, 10))
        await asyncio.sleep(0)
        gate.abort_waiting(lambda: RuntimeError("drain deadline"))
        with pytest.raises(RuntimeError, match="drain deadline"):
            await waiter
        assert gate.load() == (1, 0)
        gate.leave(first)
        assert gate.load() == (0, 0)

    asyncio.run(run())


def test_the_documented_keys_file_parses():
    """docs/SERVING.md's example keys file, as it stands there."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "SERVING.md").read_text()
    block = doc.split("### Tenants and fair admission", 1)[1].split("```\n", 2)[1]
    got = dict(parse_keys(block.splitlines(), "docs"))
    assert [t.name for t in got.values()] == ["key1", "team-a", "team-a", "batch"]
    assert got["sk-team-a-2"].tokens_per_minute == 500000 and got["sk-nightly-batch"].weight == 0.25
