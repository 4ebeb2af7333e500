"""The engine's prefix cache on the real SmolLM2 target (fp32) and on tiny random targets.

Lossless: multi-turn conversations sharing a system prompt give the tokens the cache-off engine gives (tie rule),
for every registered drafter at bs 1 and 8, with hits on prefixes a request drafted by another drafter (a
predicted output's) left behind; seeded sampling gives plain seeded decoding's tokens exactly. A hit prefills only
the rest of its prompt, and the drafters that keep their own state beside the cache hold what a cold run computes.
No slot is ever lost under eviction pressure, aborts, request and step faults, and flushes. Tenants never share.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import compare_to_reference, drafter_pools_whole, slots_whole, tiny_target

import serving.sampler as sampler_mod
import serving.spec_worker as spec_worker_mod
from serving.config import EngineConfig
from serving.engine import Engine
from serving.prefix_cache import PrefixCache
from sglang_ext.drafters import DraftInput, DraftModelDrafter, make_drafter
from sglang_ext.drafters.moa_core import MEMORY_TOKENS
from sglang_ext.sampling import SamplingParams
from sglang_ext.tree import TreeShape

NEW_TOKENS = 12
SYSTEM = "You are a concise assistant for a museum. Answer in one short sentence and do not greet the visitor."
QUESTIONS = [
    "When does the museum open?",
    "Name three famous painters.",
    "What is a sculpture?",
    "Can I take photos inside?",
    "Why do museums keep old things?",
    "What is the oldest painting you know?",
    "Suggest a name for a cat.",
    "How many legs does a spider have?",
]
FOLLOW_UP = "Say that again in other words."
DRAFTERS = [None, "ngram", "suffix", "lookahead", "draft-model", "eagle3", "moa", "moa-tli0", "moa-tli1", "medusa"]
DRAFTERS += ["suffix+eagle3"]


def chat(target, *turns: str) -> list[int]:
    """The system prompt, then alternating user / assistant turns."""
    roles = ["user", "assistant"]
    return target.encode_chat(
        [{"role": "system", "content": SYSTEM}] + [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]
    )


@pytest.fixture(scope="module")
def conversations(smollm2_fp32):
    """(first turns, second turns, the cache-off engine's outputs for both): every second turn starts with its
    first turn and the cache-off answer to it."""
    t = smollm2_fp32
    off = Engine(t, None, EngineConfig(prefix_cache=False))
    sp = SamplingParams(max_new_tokens=NEW_TOKENS)
    first = [chat(t, q) for q in QUESTIONS]
    out_first = [r.output_ids for r in off.generate(first, sp)]
    answers = [t.tokenizer.decode(o, skip_special_tokens=True) for o in out_first]
    second = [chat(t, q, a, FOLLOW_UP) for q, a in zip(QUESTIONS, answers)]
    out_second = [r.output_ids for r in off.generate(second, sp)]
    assert all(s[: len(f)] == f for f, s in zip(first, second))
    return first, second, out_first + out_second


def _spy_adopt(drafter) -> list[int]:
    """Record how many tokens' state each add_request adopted from what a drafter kept beside the cache."""
    adopted: list[int] = []
    for d in getattr(drafter, "members", None) or [drafter]:
        kept = getattr(d, "kept", None)
        if kept is not None:
            real = kept.adopt

            def adopt(keys, real=real):
                got = real(keys)
                adopted.append(got[0].numel())
                return got

            kept.adopt = adopt
    return adopted


@pytest.mark.parametrize("bs", [1, 8])
@pytest.mark.parametrize("drafter", DRAFTERS, ids=[d or "vanilla" for d in DRAFTERS])
def test_greedy_multi_turn_equals_the_cache_off_engine(smollm2_fp32, conversations, drafter, bs):
    t = smollm2_fp32
    first, second, ref = conversations
    # bs 1 serves the first half of the conversations (each step costs what a batch of 8's does)
    k = len(first) if bs > 1 else len(first) // 2
    first, second, ref = first[:k], second[:k], ref[:k] + ref[len(first) : len(first) + k]
    eng = Engine(t, make_drafter(drafter, t), EngineConfig(drafter=drafter))
    adopted = _spy_adopt(eng.drafter)
    sp = SamplingParams(max_new_tokens=NEW_TOKENS)
    # the first conversation's first turn is drafted from a predicted output (drafters/prediction.py for model
    # drafters): its prefix is cached without the drafter's own state, and its second turn rebuilds that
    predicted = SamplingParams(max_new_tokens=NEW_TOKENS, prediction=tuple(ref[0]))
    outs, reqs = [], []
    for wave in (first, second):
        for i in range(0, len(wave), bs):
            group = wave[i : i + bs]
            params = [predicted if wave is first and i + j == 0 else sp for j in range(len(group))]
            done = eng.generate(group, params)
            reqs += done
            outs += [r.output_ids for r in done]
    verdicts = [compare_to_reference(t.model, p, r, o) for p, r, o in zip(first + second, ref, outs)]
    print(f"{drafter}/bs{bs}: {verdicts.count('same')} same, {verdicts.count('tie')} ties; adopted {adopted}")
    assert "bug" not in verdicts, verdicts
    # every second turn hit its whole first turn (and, at bs 1, first turns after the first hit the system prompt)
    assert all(r.cached_tokens >= len(f) for r, f in zip(reqs[len(first) :], first))
    assert bs == 8 or all(r.cached_tokens > 20 for r in reqs[1 : len(first)])
    if drafter not in (None, "ngram", "suffix", "lookahead", "medusa"):
        assert sum(r.stats.accepted_tokens for r in reqs) > 0
    if adopted:  # drafters keeping state beside the cache reused it for the second turns
        assert sum(adopted) > sum(len(f) for f in first) // 2, adopted
    assert slots_whole(eng) and drafter_pools_whole(eng.drafter)


@pytest.fixture(scope="module")
def seeded_turns(smollm2_fp32):
    """(params, first turns, second turns, plain seeded decoding of each without a cache): three seeded requests."""
    t = smollm2_fp32
    firsts = [chat(t, q) for q in QUESTIONS[:3]]
    params = [SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.95, seed=5 + i) for i in range(3)]
    plain = Engine(t, None, EngineConfig(prefix_cache=False))
    want_first = [plain.generate([p], [sp])[0].output_ids for p, sp in zip(firsts, params)]
    seconds = [
        chat(t, q, t.tokenizer.decode(o, skip_special_tokens=True), FOLLOW_UP) for q, o in zip(QUESTIONS, want_first)
    ]
    want_second = [plain.generate([p], [sp])[0].output_ids for p, sp in zip(seconds, params)]
    return params, firsts, seconds, want_first, want_second


@pytest.mark.parametrize("drafter", ["suffix", "eagle3", "moa-tli1"])
def test_seeded_sampling_with_the_cache_is_plain_seeded_decoding(smollm2_fp32, seeded_turns, drafter):
    """Seeded sampled requests (first turns, then second turns hitting them) give exactly the tokens of plain
    seeded decoding without a cache."""
    t = smollm2_fp32
    params, firsts, seconds, want_first, want_second = seeded_turns
    eng = Engine(t, make_drafter(drafter, t), EngineConfig(drafter=drafter))
    got_first = [r.output_ids for r in eng.generate(firsts, params)]
    second = eng.generate(seconds, params)
    assert got_first == want_first and [r.output_ids for r in second] == want_second
    assert all(r.cached_tokens >= len(f) for r, f in zip(second, firsts))
    assert slots_whole(eng) and drafter_pools_whole(eng.drafter)


def test_a_hit_prefills_only_the_rest_and_counts_its_slots(smollm2_fp32):
    t = smollm2_fp32
    eng = Engine(t, None)
    rows: list[int] = []
    real = eng.model.forward

    def forward(ids, *a, **kw):
        rows.append(ids.shape[0])
        return real(ids, *a, **kw)

    eng.model.forward = forward
    try:
        a = eng.generate([chat(t, QUESTIONS[0])], SamplingParams(max_new_tokens=4))[0]
        rows.clear()
        prompt = chat(t, QUESTIONS[1])
        common = next(i for i, (x, y) in enumerate(zip(prompt, a.prompt_ids)) if x != y)
        b = eng.add_request(prompt, SamplingParams(max_new_tokens=4))
        assert b.cached_tokens == common > 20 and b.prefilled == common and len(b.slots) == common
        acc = eng.slot_accounts()
        assert acc.held == 0 and acc.cached == len(a.prompt_ids) + 3 and acc.lost == 0  # a's prompt + 3 outputs
        eng.step()
        assert rows == [len(prompt) - common] and b.output_ids  # the first token from the rest alone
        while eng.has_work:
            eng.step()
    finally:
        del eng.model.forward
    # a request asking for prompt logprobs needs every prompt row: it takes nothing from the cache
    c = eng.generate([prompt], SamplingParams(max_new_tokens=2, prompt_logprobs=0))[0]
    assert c.cached_tokens == 0 and len(c.prompt_logprobs) == len(prompt) - 1
    assert eng.generate([prompt], SamplingParams(max_new_tokens=2))[0].cached_tokens == len(prompt) - 1
    off = Engine(t, None, EngineConfig(prefix_cache=False))
    assert off.generate([prompt], SamplingParams(max_new_tokens=2))[0].cached_tokens == 0 and slots_whole(off)
    assert off.prefix_cache is None and off.slot_accounts().cached == 0


def test_tenants_never_hit_each_others_prefixes(smollm2_fp32):
    t = smollm2_fp32
    eng = Engine(t, None)
    prompt, sp = chat(t, QUESTIONS[2]), SamplingParams(max_new_tokens=3)
    eng.add_request(prompt, sp, tenant="alice")
    while eng.has_work:
        eng.step()
    for tenant, hit in (("bob", 0), ("", 0), ("alice", len(prompt) - 1)):
        r = eng.add_request(prompt, sp, tenant=tenant)
        assert r.cached_tokens == hit, tenant
        assert eng.cached_prefix(prompt, sp, tenant)[0] == len(prompt) - 1 if tenant == "alice" else True
        while eng.has_work:
            eng.step()
    assert slots_whole(eng)


@pytest.mark.parametrize("how", ["kept", "rebuilt"])
@pytest.mark.parametrize("drafter", ["eagle3", "moa", "draft-model"])
def test_state_kept_beside_the_cache_is_what_a_cold_run_computes(smollm2_fp32, drafter, how):
    """After a hit, the drafter's own K/V over the whole prompt (adopted for the cached tokens, computed for the
    rest; or, with nothing kept, rebuilt for them from the cached K/V and the cached tokens' captured layers) equals
    a cache-off engine's for the same prompt: the kept state is keyed to the right tokens."""
    t = smollm2_fp32
    warm, cold = (Engine(t, make_drafter(drafter, t), EngineConfig(prefix_cache=c)) for c in (True, False))
    warm.generate([chat(t, QUESTIONS[3])], SamplingParams(max_new_tokens=8))
    if how == "rebuilt":
        assert len(warm.drafter.kept) > 20
        warm.drafter.drop_prefix(torch.arange(1, warm.kv.num_slots))
    prompt = chat(t, QUESTIONS[4])
    states = []
    for eng in (warm, cold):
        r = eng.add_request(prompt, SamplingParams(max_new_tokens=8))
        eng.step()  # the prefill and the drafter's add_request
        d = eng.drafter
        d.propose([DraftInput(r.rid, r.token_ids, r.params, None)], TreeShape(1, 1, 2))  # processes the prompt
        states.append(_drafter_kv(d, r.rid))
        assert r.cached_tokens > 20 if eng is warm else r.cached_tokens == 0
        eng.abort(r)
    for w, c in zip(*states):
        assert w.shape == c.shape and torch.allclose(w, c, atol=1e-4, rtol=1e-4), (drafter, (w - c).abs().max())


def _drafter_kv(d, rid: int) -> list[torch.Tensor]:
    """The drafter's own K and V over a request's processed tokens, in token order (MoA's memory: of the prompt's
    last MEMORY_TOKENS tokens, which a cold run gives memory; a hit may hold older tokens' memory too)."""
    if hasattr(d, "mem"):
        st = d.reqs[rid]
        mem = st.memory_of_tokens()[-MEMORY_TOKENS:]
        assert (mem >= 0).all()
        return [d.mem.k[0][mem], d.mem.v[0][mem], d.sa.k[0][st.sa_slots], d.sa.v[0][st.sa_slots]]
    slots = d.reqs[rid].slots if hasattr(d, "reqs") else d.slots[rid]
    return [x[slots] for x in d.kv.k + d.kv.v]


# --- no slot is ever lost ---------------------------------------------------------------------------------------


def test_no_slot_is_lost_under_eviction_aborts_faults_and_flushes(monkeypatch):
    """A small pool that the cached prefixes fill again and again (evicted least recently used), requests
    aborted at random (mid-prefill too), request faults in their verify stage, step faults (the engine reset),
    flushes while requests run: after every step each slot of the target's pool is free, cached or a request's
    own, and the self-draft's pool likewise; finished greedy outputs equal a cache-off engine's."""
    vocab, rng = 32, random.Random(0)
    t = tiny_target(seed=3, vocab=vocab, hidden=32, layers=3)
    drafter = DraftModelDrafter.self_draft(t.model, layers=[0, 2], num_slots=800)
    cfg = dict(kv_slots=400, tree=TreeShape(3, 2, 6), prefill_tokens=24)
    eng = Engine(t, drafter, EngineConfig(**cfg))
    reference = Engine(t, None, EngineConfig(**cfg, prefix_cache=False))
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randrange(20, 50))] for _ in range(4)]
    step_fault, faulty_roots = {"armed": False}, set()
    real_forward, real_greedy = t.model.forward, sampler_mod.greedy_path
    real_together = {f: getattr(spec_worker_mod, f) for f in ("greedy_paths", "greedy_results")}

    def forward(*a, **kw):
        if step_fault["armed"]:
            step_fault["armed"] = False
            raise RuntimeError("injected step fault")
        return real_forward(*a, **kw)

    def greedy_path(tree, tokens):
        if int(tree.positions[0]) in faulty_roots:  # (by the root's position: this step's request of that length)
            raise RuntimeError("injected verify fault")
        return real_greedy(tree, tokens)

    def together(name):
        def verify(trees, *a, **kw):
            # a fault in the batch's verification (greedy_results on the CPU, greedy_paths on a device): the engine
            # verifies each request alone, and greedy_path above fails the faulty one
            if any(int(tree.positions[0]) in faulty_roots for tree in trees):
                raise RuntimeError("injected verify fault")
            return real_together[name](trees, *a, **kw)

        return verify

    evictions, real_evict = [], PrefixCache.evict

    def evict(cache, n):
        freed = real_evict(cache, n)
        evictions.append(freed.numel())
        return freed

    monkeypatch.setattr(t.model, "forward", forward)
    monkeypatch.setattr(sampler_mod, "greedy_path", greedy_path)
    for name in real_together:
        monkeypatch.setattr(spec_worker_mod, name, together(name))
    monkeypatch.setattr(PrefixCache, "evict", evict)
    finished, live, resets = [], [], 0
    for _ in range(400):
        while len(live) < 3:
            prompt = rng.choice(prefixes) + [rng.randrange(vocab) for _ in range(rng.randrange(1, 25))]
            live.append(eng.add_request(prompt, SamplingParams(max_new_tokens=rng.randrange(4, 30), ignore_eos=True)))
        roll = rng.random()
        if roll < 0.05:
            finished.append(live.pop(rng.randrange(len(live))))
            eng.abort(finished[-1])
        elif roll < 0.06:
            eng.flush_cache()
        elif roll < 0.09:
            faulty_roots.add(len(rng.choice(live).token_ids) - 1)
        elif roll < 0.1:
            step_fault["armed"] = True
        try:
            eng.step()
        except RuntimeError:
            eng.reset()  # what the engine loop does after a step fault
            resets += 1
        faulty_roots.clear()
        acc = eng.slot_accounts()
        assert acc.lost == 0, acc
        own = sum(s.numel() - drafter.borrowed[rid] for rid, s in drafter.slots.items())
        assert drafter.kv.num_free + len(drafter.kept) + own == drafter.kv.num_slots - 1
        finished += [r for r in live if r.finished]
        live = [r for r in live if not r.finished]
    for r in live:
        eng.abort(r)
    print(f"{len(finished)} ended, {resets} resets, {sum(evictions)} tokens evicted")
    assert resets and sum(evictions) > 200 and eng.prefix_cache.tokens
    assert any(r.error == "verify" for r in finished) and any(r.finish_reason == "abort" for r in finished)
    assert slots_whole(eng) and drafter_pools_whole(drafter)
    done = [r for r in finished if r.finish_reason == "length"]
    assert len(done) > 30 and sum(r.cached_tokens for r in done) > 100
    monkeypatch.setattr(t.model, "forward", real_forward)
    for r in done[:12]:
        ref = reference.generate([r.prompt_ids], [r.params])[0].output_ids
        assert compare_to_reference(t.model, r.prompt_ids, ref, r.output_ids) != "bug"


# --- admission ---------------------------------------------------------------------------------------------------


def test_admission_counts_a_cached_prefix_once_and_unused_cached_tokens_as_room():
    """Two requests on one cached 200-token prefix run together in a pool that could not hold both without the
    cache (each reserves only its own tokens, the prefix they share is counted once); the cache's unused tokens are
    room: a request bigger than the free slots (a full cache) is admitted at once, the cache evicted for it."""
    import asyncio

    from serving.engine_loop import EngineLoop

    t = tiny_target(seed=4, vocab=64, hidden=32, layers=2)
    tree = TreeShape(3, 2, 6)
    eng = Engine(t, None, EngineConfig(kv_slots=400, tree=tree))
    real_step, peak = eng.step, []

    def step():
        peak.append(len(eng.running) + len(eng.waiting))
        return real_step()

    eng.step = step
    engine_loop = EngineLoop(eng, max_running=8, max_queue=8)
    engine_loop.start()
    prefix, sp = [i % 60 + 1 for i in range(200)], SamplingParams(max_new_tokens=30, ignore_eos=True)
    assert 2 * (len(prefix) + 10 + 30 + tree.num_draft_tokens + 1) > eng.kv.num_slots - 1  # no room for both alone

    async def run(prompts):
        handles = [engine_loop.submit(p, sp) for p in prompts]
        outs = []
        for h in handles:
            while not (d := await h.next()).finish_reason:
                pass
            outs.append(d.finish_reason)
        return outs

    try:
        assert asyncio.run(run([prefix + [1]])) == ["length"]  # the prefix is cached, no request uses it
        peak.clear()
        assert asyncio.run(run([prefix + [2] * 10, prefix + [3] * 10])) == ["length", "length"]
        assert max(peak) == 2 and eng.prefix_cache.tokens > 200
        filler = [[61 + i % 3] * 150 for i in range(2)]  # unrelated prompts: the cache fills the pool
        assert asyncio.run(run(filler)) == ["length"] * 2 and eng.kv.num_free < 150
        usage = engine_loop.kv_cache()
        assert usage.used == usage.reserved == 0 and usage.cached == eng.prefix_cache.tokens
        assert asyncio.run(run([[63] * 300])) == ["length"]  # 330 slots: the cache made room
    finally:
        engine_loop.stop()
    assert slots_whole(eng)
