"""The prefix cache through the gateway: a real HTTP server on loopback with two API keys, the real `openai`
client, the real SmolLM2 target and the suffix drafter (online corpus on).

Isolation: two API keys, and two cache_salts under one key, never share a hit (usage.prompt_tokens_details
.cached_tokens) or a suffix-corpus entry. Operations: the prefix cache counters and gauge in /metrics, /flush_cache
under load (requests held mid-flight: none lost, every text what it is without a flush, and nothing cached before
the flush is hit after it), admission that counts the cache's unused tokens as room.
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from helpers import drafter_pools_whole, slots_whole
from prometheus_client.parser import text_string_to_metric_families

from serving.config import EngineConfig
from serving.engine import Engine
from serving.gateway.app import GatewayConfig, create_app
from serving.gateway.auth import APIKeys, key_id, tenant_key
from serving.gateway.server import ServerThread, embedded_backend
from sglang_ext.drafters.suffix import SuffixDrafter

MODEL = "smollm2"
KEYS = ("key-alice", "key-bob")
AUTH = {"Authorization": f"Bearer {KEYS[0]}"}
SYSTEM = "You answer questions about the solar system in one short sentence, without any greeting."


@pytest.fixture(scope="module")
def server(smollm2_fp32):
    drafter = SuffixDrafter.from_target(smollm2_fp32, online=True)
    engine = Engine(smollm2_fp32, drafter, EngineConfig(drafter="suffix", kv_slots=4096))
    backend, telemetry = embedded_backend(engine, MODEL, "suffix")
    app = create_app(backend, telemetry, GatewayConfig(api_keys=APIKeys(list(KEYS))))
    with ServerThread(app) as srv:
        srv.engine, srv.telemetry, srv.backend, srv.drafter = engine, telemetry, backend, drafter
        yield srv


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=300)


def ask(c: openai.OpenAI, question: str, **kw):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return c.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, **kw)


def cached(r) -> int:
    return r.usage.prompt_tokens_details.cached_tokens


def _idle(server) -> None:
    """Wait until the engine thread has released every request (a condition, not a speed)."""
    deadline = time.monotonic() + 120
    while (server.engine.has_work or server.backend.load() != (0, 0)) and time.monotonic() < deadline:
        time.sleep(0.02)


def test_two_api_keys_and_two_salts_never_share_a_hit_or_a_corpus_entry(server):
    alice, bob = client(server, KEYS[0]), client(server, KEYS[1])
    q = "How many moons does Mars have?"
    first = ask(alice, q)
    assert cached(first) == 0
    assert cached(ask(alice, q)) == first.usage.prompt_tokens - 1  # all but the last prompt token
    assert cached(ask(bob, q)) == 0  # the same prompt under another key: a miss
    assert cached(ask(bob, q)) == first.usage.prompt_tokens - 1
    # cache_salt: a namespace within the key (vLLM's meaning)
    assert cached(ask(alice, q, extra_body={"cache_salt": "team-1"})) == 0
    assert cached(ask(alice, q, extra_body={"cache_salt": "team-1"})) == first.usage.prompt_tokens - 1
    assert cached(ask(alice, q, extra_body={"cache_salt": "team-2"})) == 0
    assert cached(ask(bob, q, extra_body={"cache_salt": "team-1"})) == 0  # one salt under two keys: two tenants
    # completions and /generate take the salt too
    comp = alice.completions.create(model=MODEL, prompt=SYSTEM + " " + q, max_tokens=4, extra_body={"cache_salt": "c"})
    again = alice.completions.create(model=MODEL, prompt=SYSTEM + " " + q, max_tokens=4, extra_body={"cache_salt": "c"})
    assert comp.usage.prompt_tokens_details.cached_tokens == 0 < again.usage.prompt_tokens_details.cached_tokens
    headers = AUTH
    gen = {"text": SYSTEM + " " + q, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "cache_salt": "c"}
    assert httpx.post(server.url + "/generate", json=gen, headers=headers).json()["meta_info"]["cached_tokens"] > 0
    gen["cache_salt"] = "g"
    assert httpx.post(server.url + "/generate", json=gen, headers=headers).json()["meta_info"]["cached_tokens"] == 0
    # the suffix drafter learned each tenant's answers into that tenant's corpus only
    _idle(server)
    corpora = server.drafter.corpora
    a, b = tenant_key(key_id("Bearer " + KEYS[0]), None), tenant_key(key_id("Bearer " + KEYS[1]), None)
    assert {a, b, tenant_key(key_id("Bearer " + KEYS[0]), "team-1")} <= set(corpora) and "" not in corpora
    assert all(len(c.docs) for c in corpora.values()) and len(corpora[a].docs) == len(corpora[b].docs) == 2


def test_suffix_corpus_entries_draft_only_their_own_tenant():
    """An answer learned from one tenant's request is a draft for that tenant's requests only."""
    from sglang_ext.drafters import DraftInput
    from sglang_ext.drafters.base import TargetCapture
    from sglang_ext.sampling import SamplingParams
    from sglang_ext.tree import TreeShape

    d = SuffixDrafter([])
    sp = SamplingParams()
    d.add_request(0, TargetCapture([1, 2, 3], None, None))
    d.propose([DraftInput(0, [1, 2, 3, 70, 71, 72, 73, 74], sp, None, tenant="a")], TreeShape(3, 1, 4))
    d.remove_request(0)
    mine = d.propose([DraftInput(1, [9, 9, 71], sp, None, tenant="a")], TreeShape(3, 1, 4))[0]
    theirs = d.propose([DraftInput(2, [9, 9, 71], sp, None, tenant="b")], TreeShape(3, 1, 4))[0]
    shared = d.propose([DraftInput(3, [9, 9, 71], sp, None)], TreeShape(3, 1, 4))[0]
    assert mine.draft_tokens.tolist() == [71, 72, 73, 74]
    assert theirs.num_nodes == shared.num_nodes == 1 and list(d.corpora) == ["a"]


def _scrape(url: str) -> dict:
    values = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            values[s.name] = values.get(s.name, 0) + s.value
    return values


def test_prefix_cache_metrics(server):
    before = _scrape(server.url)
    c = client(server, KEYS[1])
    a = ask(c, "Which planet is the largest?")
    b = ask(c, "Which planet is the smallest?")
    _idle(server)
    after = _scrape(server.url)
    query = after["moa_prefix_cache_query_tokens_total"] - before["moa_prefix_cache_query_tokens_total"]
    hit = after["moa_prefix_cache_hit_tokens_total"] - before["moa_prefix_cache_hit_tokens_total"]
    assert query == a.usage.prompt_tokens + b.usage.prompt_tokens and hit == cached(a) + cached(b) > 0
    assert after["moa_prefix_cache_tokens"] == server.engine.prefix_cache.tokens > 0
    # tokens no request uses are room: neither used nor reserved
    assert after["moa_kv_cache_used_tokens"] == after["moa_kv_cache_reserved_tokens"] == 0


def test_flush_cache_under_load_loses_no_request(server):
    """Requests held mid-flight while /flush_cache runs: the flush says they keep what they use, every request
    finishes with the text it has without a flush, and what was cached before is not hit after."""
    engine, alice = server.engine, client(server, KEYS[0])
    questions = [f"Tell me one fact about {p}." for p in ("Venus", "Jupiter", "Saturn", "Neptune")]
    expected = [ask(alice, q).choices[0].message.content for q in questions]  # (and cached: hits below)
    engine_loop, held, release = server.backend.engine_loop, threading.Event(), threading.Event()
    real_step = engine.step

    def step_then_hold():
        # NOTE: the engine thread waits for all four requests to be submitted, then holds after the first step
        # after which all four still run: the flush asked for meanwhile runs right after it, between two steps,
        # with every request mid-flight, however fast the machine is (the timeouts only stop a hang)
        deadline = time.monotonic() + 300
        while not held.is_set() and sum(engine_loop.load()) < len(questions) and time.monotonic() < deadline:
            time.sleep(0.01)
        events = real_step()
        if not held.is_set() and len(engine.running) == len(questions):
            held.set()
            release.wait(timeout=300)
        return events

    engine.step = step_then_hold
    results: list = [None] * (len(questions) + 1)

    def run(i):
        results[i] = ask(alice, questions[i])

    def flush():
        results[-1] = httpx.post(server.url + "/flush_cache", headers=AUTH, timeout=300)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(questions))]
    try:
        for th in threads:
            th.start()
        assert held.wait(timeout=300)
        threads.append(threading.Thread(target=flush))
        threads[-1].start()
        while not engine_loop._flushes and threads[-1].is_alive():
            time.sleep(0.01)
    finally:
        release.set()
        for th in threads:
            th.join(timeout=300)
        del engine.step
    flush, results = results[-1], results[:-1]
    body = flush.json()
    assert flush.status_code == 200 and body["success"] and "running requests" in body["message"], body
    assert [r.choices[0].message.content for r in results] == expected
    assert all(cached(r) > 0 for r in results)  # they ran on the cached prefixes the flush let them keep
    assert cached(ask(alice, questions[0])) == 0  # flushed for real: no hit on what was cached before
    _idle(server)
    assert slots_whole(engine) and drafter_pools_whole(engine.drafter)
    assert httpx.get(server.url + "/flush_cache", headers=AUTH).json()["success"]  # (GET too, as SGLang)


def test_cached_tokens_nobody_uses_are_room_for_admission(smollm2_fp32):
    """A pool the cache has filled admits a request at once (evicting), never queues or refuses it."""
    engine = Engine(smollm2_fp32, None, EngineConfig(kv_slots=400))
    backend, telemetry = embedded_backend(engine, MODEL, "none", max_prompt_tokens=300)
    with ServerThread(create_app(backend, telemetry)) as srv:
        srv.engine, srv.backend = engine, backend
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        for i in range(6):  # different prompts: the cache fills the pool
            c.completions.create(model=MODEL, prompt=f"{i} " + "word " * 40, max_tokens=30, temperature=0)
        _idle(srv)
        assert engine.prefix_cache.tokens > 200 and engine.kv.num_free < 200
        usage = backend.kv_cache()
        assert usage.used == usage.reserved == 0 and usage.cached == engine.prefix_cache.tokens
        r = c.completions.create(model=MODEL, prompt="new " * 150, max_tokens=64, temperature=0)
        assert r.usage.completion_tokens > 0 and slots_whole(engine)
