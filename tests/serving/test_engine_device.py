"""Engine.step on an accelerator, checked on the CPU: the step's one device-to-host copy.

The engine runs on fake CUDA tensors (FakeTensorMode) at SmolLM2's widths (4 layers) with random weights: any host
read of a device value (`.item()`, `int(t)`, `bool(t)`, `.tolist()`, a boolean-mask gather, `nonzero`)
raises there, and so does any CPU tensor mixed into device math. Fake tensors hold no values, so the
one copy the engine is allowed, `verify.to_host` (the accepted paths and first tokens of every request,
at once), is the single stand-in: it checks that what it is given lives on the device, counts its
calls, and answers plausible paths so that the host bookkeeping after it runs too. A read added
anywhere in the step (an `int(tensor)` in the loop, a per-request copy) makes a request fail in its
stage or the step raise, and the test fails; so does a second copy per step.

Covered: prefill (whole and chunked) with first tokens, arrivals in the decode forward, greedy,
seeded and unseeded sampling, penalties + min_tokens, root-only and drafted trees (a test drafter
that drafts on the device without reading it, with an out-of-vocabulary token in one tree), the
drafter's commit, output logprobs (computed on the device, they come in the same copy), prefix cache
hits (follow-up requests on the first ones' prompts and outputs: the cached tokens' captured layers
gathered on the device, model drafters adopting the state they kept beside the cache). Not covered
here (a copy of their own, documented in the engine): prompt logprobs and grammar masks.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers import HostWaits, smollm2_config
from torch._subclasses.fake_tensor import FakeTensorMode

import serving.engine as engine_mod
from serving.config import EngineConfig
from serving.engine import Engine
from sglang_ext import sampling
from sglang_ext.attention import tree_attention_torch
from sglang_ext.drafters import Drafter
from sglang_ext.models import Target
from sglang_ext.sampling import SamplingParams, TokenLogprob
from sglang_ext.tree import TreeShape, chain_tree
from sglang_ext.verify import VerifyResult

DRAFT = [5, 9]  # the test drafter's chain after every root
OOV_EVERY = 3  # every 3rd propose drafts a token outside the vocabulary for its first request


class DeviceChainDrafter(Drafter):
    """Drafts DRAFT after every root, built on the target's device from host ints (no device read);
    records where the commits' tensors live."""

    name, capture_layers = "device-chain", (3,)

    def __init__(self, device: str, vocab: int):
        self.device, self.vocab, self.proposals, self.commits, self.cached_rows = device, vocab, 0, [], []

    def add_request(self, rid, capture):
        self.commits.append(capture)
        if capture.cached:  # a prefix cache hit: the cached tokens' captured rows, gathered on the device too
            self.cached_rows.append((capture, capture.cached_hidden(0)))

    def propose(self, batch, shape):
        self.proposals += 1
        trees = []
        for i, d in enumerate(batch):
            draft = [self.vocab + 7, 9] if i == 0 and self.proposals % OOV_EVERY == 0 else DRAFT
            trees.append(chain_tree(d.token_ids[-1], draft, d.seq_len, device=self.device))
        return trees

    def commit(self, rid, capture):
        self.commits.append(capture)

    def remove_request(self, rid):
        pass


class OneCopy:
    """Stands in for verify.to_host under fake tensors: counts the calls, checks the paths are on the
    device, and answers: a drafted chain's first draft accepted (DRAFT[0], then a bonus), else the root
    alone with a bonus."""

    def __init__(self, device: str = "cuda"):
        self.calls, self.device, self.logprobs = 0, device, 0

    def __call__(self, paths):
        self.calls += 1
        out = []
        for p in paths:
            assert p.nodes.device.type == p.tokens.device.type == self.device
            n = p.nodes.numel()
            argmax = None  # (the target's argmax at every node, for a drafter that asked: copied here too)
            if p.tree_argmax is not None:
                assert p.tree_argmax.device.type == self.device and p.tree_argmax.numel() == n
                argmax = [11] * n
            if n > 1:
                assert p.draft_invalid is not None and p.draft_invalid.device.type == self.device
                res = VerifyResult([0, 1], [DRAFT[0], 11], tree_argmax=argmax)
            else:
                res = VerifyResult([0], [11], tree_argmax=argmax)
            if p.logprobs is not None:  # (a request that asked for logprobs: its tokens', copied here too)
                chosen, vals, ids = p.logprobs
                assert all(x.device.type == self.device for x in p.logprobs) and chosen.shape == (n,)
                k = vals.shape[1]
                res.logprobs = [TokenLogprob(t, -0.5, tuple((t, -0.5) for _ in range(k))) for t in res.tokens]
                self.logprobs += 1
            out.append(res)
        return out


def _follow_ups(eng: Engine, reqs: list, params: list) -> list:
    """Requests continuing each finished one (its prompt, its output, three more tokens): prefix cache hits."""
    follow = [eng.add_request(r.prompt_ids + r.output_ids + [7, 8, 9], sp) for r, sp in zip(reqs, params)]
    assert all(r.cached_tokens >= len(old.prompt_ids) for r, old in zip(follow, reqs))
    return follow


def _run_counting_copies(eng: Engine, copy: OneCopy, arrive=None) -> None:
    """Step the engine until it is idle: exactly one copy per step that emits tokens, none otherwise;
    arrive() (if given) adds a request before step 2."""
    steps = 0
    while eng.has_work:
        if steps == 2 and arrive is not None:
            arrive()
        before = copy.calls
        events = eng.step()
        steps += 1
        assert copy.calls - before == (1 if any(e.new_tokens for e in events) else 0), steps
        assert steps < 40


PARAMS = [
    SamplingParams(max_new_tokens=6, logprobs=2),
    SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.9, seed=3),
    SamplingParams(max_new_tokens=6, temperature=1.0, top_k=50),
    SamplingParams(max_new_tokens=6, presence_penalty=0.5, repetition_penalty=1.2, min_tokens=4, stop_token_ids=(4,)),
]


@pytest.mark.parametrize("drafted", [False, True], ids=["vanilla", "drafted"])
def test_an_engine_step_makes_one_device_to_host_copy(monkeypatch, drafted):
    # NOTE: a CUDA generator needs a CUDA runtime, and fake tensors draw from no generator at all: the
    # requests get None (the default stream); what is drawn is irrelevant here, fake tensors hold no values
    monkeypatch.setattr(sampling, "device_generator", lambda seed, device="cpu": None)
    copy = OneCopy()
    monkeypatch.setattr(engine_mod, "to_host", copy)
    fallbacks = []
    cfg = replace(smollm2_config(), num_layers=4)  # SmolLM2's widths and vocabulary, fewer layers
    with FakeTensorMode(allow_non_fake_inputs=True):
        from sglang_ext.models import synthetic

        model = synthetic.random_target(cfg, "cuda")
        model.attention = tree_attention_torch  # (the Triton kernels need a real GPU)
        model.gpu_layer_ops = False
        drafter = DeviceChainDrafter("cuda", cfg.vocab_size) if drafted else None
        # (capturing a CUDA graph needs a real GPU: this proves the eager step; gpu tests cover replay)
        config = EngineConfig(
            kv_slots=4096, prefill_tokens=24, tree=TreeShape.chain(2), adaptive=False, cuda_graphs=False
        )
        eng = Engine(Target(model, None, None), drafter, config, on_fallback=lambda r, why: fallbacks.append(why))
        prompts = [list(range(10, 10 + n)) for n in (9, 30, 5)]  # 30 > prefill_tokens: chunked
        reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, PARAMS)]
        # an arrival at step 2, while the others decode: prefilled in their forward
        with HostWaits() as waits:  # (the requests' steps: loading the weights above copies them up)
            _run_counting_copies(eng, copy, lambda: reqs.append(eng.add_request(list(range(40, 52)), PARAMS[3])))
            reqs += _follow_ups(eng, reqs, PARAMS)
            _run_counting_copies(eng, copy)
    errors = [(r.rid, r.error) for r in reqs if r.finish_reason == "error"]
    assert not waits.raised, waits.raised
    assert not errors, f"a stage read the device or mixed devices: {errors}"
    assert all(r.finish_reason == "length" and len(r.output_ids) == 6 for r in reqs)
    if drafted:  # a hit's capture: rows of the captured layer for the tokens computed now, and for the cached ones
        assert len(drafter.cached_rows) >= 4 and all(
            c.hidden[3].shape[0] == len(c.token_ids) - c.cached and rows[3].shape[0] == c.cached
            for c, rows in drafter.cached_rows
        )
        assert all(rows[3].device.type == "cuda" for _, rows in drafter.cached_rows)
    # (the OOV tree's flag reaches the host through the copy, which the stand-in answers with False;
    # tests/serving/test_gateway_errors.py checks that fallback with real values)
    assert not fallbacks
    assert copy.logprobs > 0 and len(reqs[0].output_logprobs) == 6  # (every token's, from the copies)
    if drafted:
        assert drafter.commits and all(
            c.positions.device.type == "cuda" and all(h.device.type == "cuda" for h in c.hidden.values())
            for c in drafter.commits
        )
        assert sum(r.stats.accepted_tokens for r in reqs) > 0


@pytest.mark.parametrize(
    "kind,static",
    [("eagle3", False), ("eagle3", True), ("moa", False), ("moa", True), ("draft-model", False)]
    + [("draft-model", True), ("medusa", False), ("lookahead", False)],
)
def test_an_engine_step_with_a_model_drafter_makes_one_copy(monkeypatch, kind, static):
    """The same with a real model drafter searching trees (EAGLE-3, MoA, the self-draft, Medusa's heads),
    all on the meta device (it stands for the GPU as fake CUDA does; the drafters' modules cannot be
    faked): the search, its paths and plans, the commit of each verify step add no read of their own.
    Lookahead's commit reads the target's argmax at every node: it arrives in the same copy. `static`: the
    drafter's search steps take its step runner's static path (what a GPU replays as CUDA graphs, run
    eagerly here): their host rows go up queued, never by a copy the host waits on.
    (A merged drafter reads its members' trees to merge them on the host: not covered, by design.)"""
    from sglang_ext.drafters import DraftModelDrafter
    from sglang_ext.drafters.eagle3 import Eagle3Drafter
    from sglang_ext.drafters.lookahead import LookaheadDrafter
    from sglang_ext.drafters.medusa import MedusaDrafter
    from sglang_ext.drafters.moa import MoADrafter
    from sglang_ext.models import synthetic
    from sglang_ext.models.eagle3 import Eagle3Config, Eagle3Draft
    from sglang_ext.models.medusa import MedusaConfig, MedusaHeads
    from sglang_ext.models.moa import MoAConfig, MoADraft

    monkeypatch.setattr(sampling, "device_generator", lambda seed, device="cpu": None)
    copy = OneCopy("meta")
    monkeypatch.setattr(engine_mod, "to_host", copy)
    cfg = replace(smollm2_config(), num_layers=4)
    model = synthetic.random_target(cfg, "meta")
    model.attention = tree_attention_torch
    if kind == "eagle3":
        drafter = Eagle3Drafter(model, Eagle3Draft(Eagle3Config.for_target(cfg, 2048)), num_slots=1024)
    elif kind == "moa":
        drafter = MoADrafter(model, MoADraft(MoAConfig.for_target(cfg, tli=1, draft_vocab_size=2048)), num_slots=1024)
    elif kind == "medusa":
        drafter = MedusaDrafter(model, MedusaHeads(MedusaConfig.for_target(cfg, num_heads=3, draft_vocab_size=2048)))
    elif kind == "lookahead":  # a host drafter that learns from the target's argmax at every node
        drafter = LookaheadDrafter()
    else:
        drafter = DraftModelDrafter.self_draft(model, layers=[0, 3], num_slots=1024)
    drafter.step_graphs = static  # (the engine sets it with a graph runner, which needs a CUDA device)
    adopted = []  # tokens of state each add_request adopted from what the drafter kept beside the prefix cache
    if hasattr(drafter, "kept"):
        real_adopt = drafter.kept.adopt
        drafter.kept.adopt = lambda keys: (got := real_adopt(keys), adopted.append(got[0].numel()))[0]
    fallbacks = []
    config = EngineConfig(kv_slots=4096, prefill_tokens=24, tree=TreeShape(3, 2, 6), adaptive=False, cuda_graphs=False)
    eng = Engine(Target(model, None, None), drafter, config, on_fallback=lambda r, why: fallbacks.append(why))
    reqs = [eng.add_request(list(range(10, 10 + n)), sp) for n, sp in zip((9, 30, 5), PARAMS[:3])]
    with HostWaits() as waits:
        _run_counting_copies(eng, copy)
        reqs += _follow_ups(eng, reqs, PARAMS[:3])
        _run_counting_copies(eng, copy)
    assert not waits.raised, waits.raised
    errors = [(r.rid, r.error) for r in reqs if r.finish_reason == "error"]
    assert not errors and not fallbacks, (errors, fallbacks)
    assert all(len(r.output_ids) == 6 for r in reqs)
    assert sum(r.stats.accepted_tokens for r in reqs) > 0  # drafted trees were verified (the stand-in accepts one)
    assert sum(adopted) > 0 or not hasattr(drafter, "kept")


@pytest.mark.parametrize("kind", [None, "eagle3"], ids=["vanilla", "eagle3"])
def test_a_replayed_step_makes_one_copy_and_reads_its_prefixes_from_the_device(monkeypatch, kind):
    """The target's steps on its graph runner's static path (what a GPU replays; run eagerly on the meta device):
    a plain greedy decode step (the slot table, the logits and argmax in its graph) copies its tokens once, a
    drafted one its greedy paths (taken in its graph) once; no host wait, every request to its length."""
    import serving.decode_step as decode_mod
    from sglang_ext.drafters.eagle3 import Eagle3Drafter
    from sglang_ext.models import synthetic
    from sglang_ext.models.eagle3 import Eagle3Config, Eagle3Draft
    from sglang_ext.models.graph_runner import GraphRunner

    copy, tokens = OneCopy("meta"), []
    monkeypatch.setattr(engine_mod, "to_host", copy)

    def tokens_to_host(t):
        assert t.device.type == "meta" and t.dim() == 1
        tokens.append(t.numel())
        return [11] * t.numel()

    monkeypatch.setattr(decode_mod, "tokens_to_host", tokens_to_host)
    cfg = replace(smollm2_config(), num_layers=2)
    model = synthetic.random_target(cfg, "meta")
    model.attention = tree_attention_torch
    drafter = Eagle3Drafter(model, Eagle3Draft(Eagle3Config.for_target(cfg, 2048)), num_slots=1024) if kind else None
    config = EngineConfig(kv_slots=4096, prefill_tokens=24, tree=TreeShape(3, 2, 6), adaptive=False, cuda_graphs=False)
    eng = Engine(Target(model, None, None), drafter, config)
    eng.runner.graph_runner = GraphRunner(eng.model, eng.capture_layers, graphs=False)
    if drafter is not None:
        drafter.step_graphs = True
    reqs = [eng.add_request(list(range(10, 10 + n)), SamplingParams(max_new_tokens=6)) for n in (9, 30, 5)]
    with HostWaits() as waits:
        steps = 0
        while eng.has_work:
            before = copy.calls + len(tokens)
            events = eng.step()
            assert copy.calls + len(tokens) - before == (1 if any(e.new_tokens for e in events) else 0)
            steps += 1
            assert steps < 40
    assert not waits.raised, waits.raised
    assert all(r.finish_reason == "length" and len(r.output_ids) == 6 for r in reqs), [r.error for r in reqs]
    assert eng.runner.graph_runner.runs > 0 and (len(tokens) > 0) == (kind is None)
