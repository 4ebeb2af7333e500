"""One request's fault fails that request alone: the engine (per stage), the engine loop, and the gateway.

A fault is injected into one request of a batch (a penalty, mask, verification or logprob function that
raises for that request only); the other requests must produce exactly the tokens of a fault-free run,
the faulty one must end with finish_reason "error" and the stage as its error, and the KV pool must end
with every slot free. A fault no request can be blamed for fails the step, and the engine restarts clean.
"""

from __future__ import annotations

import pytest
import torch
from helpers import slots_whole, tiny_target

import serving.engine as engine_mod
import serving.sampler as sampler_mod
from serving.config import EngineConfig
from serving.engine import Engine
from sglang_ext.drafters import NgramDrafter
from sglang_ext.sampling import SamplingParams
from sglang_ext.tree import TreeShape

VOCAB = 64
FAULTY = 2  # which request of the batch faults


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=5, vocab=VOCAB, hidden=32, layers=2)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    # the faulty prompt is the longest: its chunks span several prefill steps at prefill_tokens=8
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 30, 7)]


def params(i: int) -> SamplingParams:
    # every request runs every stage under test: penalties, min_tokens, logprobs (prompt and output)
    return SamplingParams(
        max_new_tokens=16,
        presence_penalty=0.5,
        min_tokens=4 + (i == FAULTY),
        logprobs=2,
        prompt_logprobs=1,
        ignore_eos=True,
    )


def run(target, prefill_tokens: int = 8) -> tuple[list, Engine]:
    engine = Engine(
        target, NgramDrafter(), EngineConfig(tree=TreeShape(3, 2, 6), kv_slots=1024, prefill_tokens=prefill_tokens)
    )
    reqs = [engine.add_request(p, params(i)) for i, p in enumerate(prompts())]
    while engine.has_work:
        engine.step()
    return reqs, engine


def faulty_call(module, name: str, is_faulty, after: int):
    """The engine's `name` (as `module` calls it), raising for the faulty request from its `after`-th call on."""
    real, calls = getattr(module, name), {"n": 0}

    def wrapper(*args, **kw):
        if is_faulty(*args, **kw):
            calls["n"] += 1
            if calls["n"] > after:
                raise RuntimeError(f"injected fault in {name}")
        return real(*args, **kw)

    return wrapper


FAULTY_PROMPT = prompts()[FAULTY]


def in_faulty_prompt(tokens: list[int]) -> bool:
    """Whether `tokens` (a chunk's prompt tokens, logprobs asked with k=1) run inside the faulty prompt."""
    n = len(tokens)
    return n > 2 and any(FAULTY_PROMPT[j : j + n] == tokens for j in range(1, len(FAULTY_PROMPT) - n + 1))


INJECTIONS = {
    # stage: (the engine's module that calls it, function, does this call belong to the faulty request?)
    "penalty": (sampler_mod, "penalize_tree", lambda logits, params, prompt_ids, *a: prompt_ids == FAULTY_PROMPT),
    "mask": (sampler_mod, "ban_early_stops", lambda logits, tree, output_len, min_tokens, stops: min_tokens == 5),
    "logprobs": (engine_mod, "token_logprobs", lambda logits, tokens, k: k == 1 and in_faulty_prompt(tokens)),
    "verify": (sampler_mod, "greedy_path", lambda tree, tokens: int(tree.positions[0]) >= len(FAULTY_PROMPT)),
}


@pytest.fixture(scope="module")
def fault_free(target):
    reqs, engine = run(target)
    assert all(r.finish_reason == "length" and len(r.output_ids) == 16 for r in reqs)
    return [r.output_ids for r in reqs]


@pytest.mark.parametrize("after", [0, 2], ids=["first-call", "later-call"])
@pytest.mark.parametrize("stage", sorted(INJECTIONS))
def test_a_fault_fails_one_request_and_the_others_run_unchanged(target, fault_free, monkeypatch, stage, after):
    module, name, is_faulty = INJECTIONS[stage]
    monkeypatch.setattr(module, name, faulty_call(module, name, is_faulty, after))
    reqs, engine = run(target)
    bad = reqs[FAULTY]
    assert bad.finish_reason == "error" and bad.error == stage
    for i, r in enumerate(reqs):
        if i != FAULTY:
            assert r.finish_reason == "length" and r.error is None
            assert r.output_ids == fault_free[i], f"request {i} changed after request {FAULTY}'s fault"
    assert slots_whole(engine) and not engine.waiting and not engine.running


def test_step_fault_then_reset_leaves_a_whole_kv_pool(target, fault_free):
    engine = Engine(target, NgramDrafter(), EngineConfig(tree=TreeShape(3, 2, 6), kv_slots=1024))
    for i, p in enumerate(prompts()):
        engine.add_request(p, params(i))
    engine.step()
    engine.step()
    leaked = engine.kv.alloc(7)  # slots no request holds: what a fault mid-step could leave behind
    assert leaked.numel() == 7
    engine.reset()
    assert slots_whole(engine) and not engine.has_work
    again = [engine.add_request(p, params(i)) for i, p in enumerate(prompts())]  # and it serves as before
    while engine.has_work:
        engine.step()
    assert [r.output_ids for r in again] == fault_free
    assert slots_whole(engine)


# --- through the gateway: the faulty request gets an OpenAI-shaped error, the fault is counted ----------
def test_gateway_fails_the_faulty_request_alone_and_counts_it(monkeypatch):
    import concurrent.futures as cf

    import httpx
    import openai
    from helpers import tiny_config, tiny_state

    from serving.gateway.app import create_app
    from serving.gateway.server import ServerThread, embedded_backend
    from sglang_ext.models import LlamaModel, Target
    from sglang_ext.models.loader import load_tokenizer, resolve_target

    cfg = tiny_config(vocab=49152, hidden=32, layers=2)
    tiny = Target(LlamaModel(cfg, tiny_state(cfg, seed=3)), load_tokenizer(resolve_target("smollm2")), None)
    engine = Engine(tiny, NgramDrafter(), EngineConfig(tree=TreeShape(3, 2, 6), kv_slots=4096))
    backend, telemetry = embedded_backend(engine, "tiny", "ngram")
    kw = dict(
        model="tiny",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
        presence_penalty=0.5,
    )
    topics = ["cats", "rain", "bread"]
    with ServerThread(create_app(backend, telemetry)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(topic: str):
            return client.chat.completions.create(messages=[{"role": "user", "content": topic}], **kw).choices[0]

        alone = [ask(t) for t in topics]
        faulty_prompt = tiny.encode_chat([{"role": "user", "content": "poison"}])
        monkeypatch.setattr(
            sampler_mod,
            "penalize_tree",
            faulty_call(sampler_mod, "penalize_tree", lambda l, p, prompt_ids, *a: prompt_ids == faulty_prompt, 1),
        )

        def poisoned():
            with pytest.raises(openai.APIError, match=r"internal error \(penalty\)"):
                for _ in client.chat.completions.create(
                    messages=[{"role": "user", "content": "poison"}], stream=True, **kw
                ):
                    pass

        with cf.ThreadPoolExecutor(4) as pool:
            bad = pool.submit(poisoned)
            together = list(pool.map(ask, topics))
            bad.result()
        metrics = httpx.get(srv.url + "/metrics").text
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert all(c.finish_reason == "length" for c in together)
    assert 'moa_request_faults_total{backend="embedded",drafter="ngram",reason="penalty"} 1.0' in metrics
    assert telemetry._requests["error"]._value.get() == 1
    assert slots_whole(engine)


class PoisonedEagle3:
    """A real EAGLE-3 drafter whose weights turn NaN from its `after`-th propose on (a faulty checkpoint
    or kernel): its logits are non-finite, its trees still hold valid ids."""

    def __new__(cls, target, after: int):
        from sglang_ext.drafters.eagle3 import Eagle3Drafter
        from sglang_ext.models.eagle3 import Eagle3Config, Eagle3Draft

        cfg = target.model.cfg
        d = Eagle3Drafter(target.model, Eagle3Draft(Eagle3Config.for_target(cfg, 48, aux_layers=(0, 1, 1))))
        real, calls = d.propose, []

        def propose(batch, shape):
            calls.append(1)
            if len(calls) == after:
                for p in d.draft.parameters():
                    p.data.fill_(float("nan"))
            return real(batch, shape)

        d.propose = propose
        return d


@pytest.mark.parametrize("shape", ["3,2,6", "3"], ids=["tree", "chain"])
def test_non_finite_draft_logits_fall_back_with_the_targets_tokens(target, shape):
    """Non-finite draft logits are caught in the step's one copy (not by a read inside the search): the
    step's tree is still verified losslessly, then the request falls back to vanilla decoding. Greedy
    and seeded sampling (sampled chains draw from the uniform distribution instead of NaN) give exactly
    the tokens of a run without a drafter."""
    sp = [
        SamplingParams(max_new_tokens=12, ignore_eos=True),
        SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.9, seed=4),
    ]
    ids = prompts()[:2]
    ref = [r.output_ids for r in Engine(target, None).generate(ids, sp)]
    why = []
    engine = Engine(
        target,
        PoisonedEagle3(target, after=3),
        EngineConfig(tree=TreeShape.parse(shape), kv_slots=1024, adaptive=False),
        on_fallback=lambda r, reason: why.append(reason),
    )
    reqs = [engine.add_request(p, s) for p, s in zip(ids, sp)]
    while engine.has_work:
        engine.step()
    assert [r.output_ids for r in reqs] == ref
    assert why == ["invalid_draft", "invalid_draft"] and not any(r.drafting for r in reqs)
    assert slots_whole(engine)
