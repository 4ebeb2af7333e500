"""MoA: training masks, LSA once per verified token, TLI reads (never writes) the target cache,
checkpoint round trip, train == inference, greedy identity through the engine, training lowers loss."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import (
    compare_to_reference,
    drafter_pools_whole,
    off_stretches_run,
    scripted_policy,
    slots_whole,
    tiny_config,
    tiny_state,
    together_and_alone,
)

from serving.config import EngineConfig
from serving.engine import Engine
from sglang_ext.drafters import make_drafter
from sglang_ext.drafters.base import DraftInput
from sglang_ext.drafters.moa import MoADrafter
from sglang_ext.drafters.moa_core import CATCH_UP_COMMITS, MEMORY_TOKENS
from sglang_ext.models import LlamaModel, Target
from sglang_ext.models.checkpoint import CheckpointError
from sglang_ext.models.moa import MoAConfig, MoADraft, load_moa
from sglang_ext.sampling import SamplingParams
from sglang_ext.training.data import Batch, Example, make_batches
from sglang_ext.training.moa import MoATask, ca_mask, last_points, sa_mask, tli_masks
from sglang_ext.training.target import TargetRunner
from sglang_ext.training.trainer import OptimConfig, RunConfig, Trainer
from sglang_ext.tree import TreeShape

VOCAB, DRAFT_VOCAB, LAYERS = 64, 48, 6


def tiny_pair(tli=0, seed=0, draft_vocab=DRAFT_VOCAB, sa="self", memory="lsa") -> tuple[Target, MoADraft]:
    cfg = tiny_config(vocab=VOCAB, layers=LAYERS)
    target = Target(model=LlamaModel(cfg, tiny_state(cfg, seed)), tokenizer=None, path=None)
    torch.manual_seed(seed)
    draft = MoADraft(
        MoAConfig.for_target(cfg, tli=tli, draft_vocab_size=draft_vocab, sa_tree_attention=sa, memory_source=memory)
    )
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # norms away from 1, so the tests see every weight
    if draft_vocab:
        draft.set_vocab(torch.arange(draft_vocab))
    return target, draft


# --- masks, hand-checked ----------------------------------------------------------------------
def test_masks_match_the_definition_on_a_small_example():
    v = torch.tensor([[0, 0, 0, 0, 0, 4, 4]])  # points {0, 4}: rows 1-4 after point 0, rows 5-6 after point 4
    T, F = True, False
    assert ca_mask(v)[0].tolist() == [
        [T, F, F, F, F, F, F],  # row 0: dummy (never a query at inference)
        [T, F, F, F, F, F, F],
        [T, F, F, F, F, F, F],
        [T, F, F, F, F, F, F],
        [T, F, F, F, F, F, F],
        [T, T, T, T, T, F, F],
        [T, T, T, T, T, F, F],
    ]
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    assert torch.equal(sa_mask(v, torch.tensor([False]))[0], causal)
    assert sa_mask(v, torch.tensor([True]))[0].tolist() == [
        [T, F, F, F, F, F, F],
        [T, T, F, F, F, F, F],
        [T, F, T, F, F, F, F],
        [T, F, F, T, F, F, F],
        [T, F, F, F, T, F, F],
        [T, T, T, T, T, T, F],
        [T, T, T, T, T, F, T],
    ]
    m = tli_masks(v)[0]
    real, draft = m[:, :7], m[:, 7:]
    assert torch.equal(real, ca_mask(v)[0])
    assert draft[3].tolist() == [F, T, T, T, F, F, F] and draft[6].tolist() == [F, F, F, F, F, T, T]
    assert not draft[0].any()  # row 0 sees the real key 0 only


def test_verification_points_gaps_are_in_range():
    v = last_points(2, 200, 6, 14, torch.Generator().manual_seed(0))
    assert (v[:, 1:] < torch.arange(1, 200)).all()
    for row in v:
        points = sorted(set(row.tolist()))
        assert points[0] == 0
        gaps = [b - a for a, b in zip(points, points[1:])]
        assert gaps and all(6 <= g <= 14 for g in gaps), gaps


# --- inference ----------------------------------------------------------------------------------
def _prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(k),), generator=g).tolist() for k in torch.randint(3, 20, (n,), generator=g)]


def test_lsa_runs_once_per_verified_token():
    target, draft = tiny_pair(tli=1)
    drafter = MoADrafter(target.model, draft)
    shapes = []
    lsa = drafter.draft.lsa
    drafter.draft.lsa = lambda x: shapes.append(tuple(x.shape)) or lsa(x)
    eng = Engine(target, drafter, EngineConfig(tree=TreeShape(4, 3, 10)))
    prompt = _prompts(1, 0)[0]
    req = eng.add_request(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))
    verified = []
    while not req.finished:
        eng.step()
        verified.append(len(req.slots))
    # prefill: the prompt's last MEMORY_TOKENS; each verify step: only root + accepted nodes (LSA'd at the next
    # propose), never the prefix again
    assert len(prompt) > MEMORY_TOKENS and shapes[0] == (MEMORY_TOKENS, LAYERS, draft.cfg.lsa_hidden)
    assert all(s[1:] == (LAYERS, draft.cfg.lsa_hidden) for s in shapes)
    added = [b - a for a, b in zip(verified, verified[1:]) if b > a]
    assert [s[0] for s in shapes[1 : 1 + len(added)]] == added
    assert drafter.lsa_rows == sum(s[0] for s in shapes)


def _one_propose(drafter, eng, prompt, shape):
    req = eng.add_request(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))
    eng.step()  # prefill: drafter.add_request, first token = root
    inp = DraftInput(req.rid, req.token_ids, req.params, None)
    return req, drafter.propose([inp], shape)[0]


def test_tli_reads_the_target_cache_and_never_writes_it():
    target, draft = tiny_pair(tli=1, seed=3)
    drafter = MoADrafter(target.model, draft)
    eng = Engine(target, drafter, EngineConfig(tree=TreeShape(3, 2, 6)))
    req, tree = _one_propose(drafter, eng, _prompts(1, 5)[0], TreeShape(3, 2, 6))
    kv = eng.kv
    free = kv.num_free
    snapshot = [(k.clone(), v.clone()) for k, v in zip(kv.k, kv.v)]
    logits = []
    head = drafter._to_logits
    drafter._to_logits = lambda h, full: logits.append(head(h, full)) or logits[-1]
    inp = DraftInput(req.rid, req.token_ids, req.params, None)
    drafter.propose([inp], TreeShape(3, 2, 6))
    # speculative K/V went to temporary slots that are free again; verified K/V untouched
    assert kv.num_free == free
    for (k0, v0), k1, v1 in zip(snapshot, kv.k, kv.v):
        assert torch.equal(k0[req.slots], k1[req.slots]) and torch.equal(v0[req.slots], v1[req.slots])
    base = logits[0].clone()
    # the last target layer's cached K of a verified position feeds the draft: change it, the draft changes
    last = len(target.model.layers) - 1
    slot = req.slots[-2]
    orig = kv.k[last][slot].clone()
    kv.k[last][slot] += 3.0
    logits.clear()
    drafter.propose([inp], TreeShape(3, 2, 6))
    assert not torch.allclose(logits[0], base)
    # an earlier layer only matters through LSA, which already ran for these tokens: no change now
    kv.k[last][slot] = orig  # restored exactly (+= 3 then -= 3 would round)
    kv.k[0][slot] += 3.0
    logits.clear()
    drafter.propose([inp], TreeShape(3, 2, 6))
    assert torch.allclose(logits[0], base)


def test_save_load_round_trip_is_exact(tmp_path):
    target, draft = tiny_pair(tli=1, seed=1)
    draft.save(tmp_path / "ck", dtype=torch.float32, extra_config={"training": {"step": 3}})
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["architectures"] == ["MoADraftModel"] and cfg["tli"] == 1 and cfg["training"]["step"] == 3
    loaded = load_moa(tmp_path / "ck", target.cfg)
    for (k, a), (k2, b) in zip(draft.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "ck" / "model.safetensors")))
    groups = {n.split(".")[0] for n in names}
    assert groups == {"layer_self_attention", "Ekv2E", "self_attention", "cross_attention", "hot_ids"}
    # same draft logits through the drafter
    prompt = _prompts(1, 2)[0]
    outs = []
    for d in (draft, loaded):
        dr = MoADrafter(target.model, d)
        eng = Engine(target, dr, EngineConfig(tree=TreeShape(3, 2, 6)))
        outs.append(_one_propose(dr, eng, prompt, TreeShape(3, 2, 6))[1].draft_tokens)
    assert torch.equal(outs[0], outs[1])


def test_bad_checkpoints_give_clear_errors(tmp_path):
    target, draft = tiny_pair()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_moa(tmp_path, target.cfg)
    draft.save(tmp_path / "ck")
    other = tiny_config(vocab=VOCAB, layers=LAYERS + 1)
    with pytest.raises(CheckpointError, match="num_target_layers"):
        load_moa(tmp_path / "ck", other)
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg | {"architectures": ["LlamaForCausalLMEagle3"]}))
    with pytest.raises(CheckpointError, match="not a MoA checkpoint"):
        load_moa(tmp_path / "ck")
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg | {"tli": 99}))
    with pytest.raises(CheckpointError, match="tli=99"):
        load_moa(tmp_path / "ck")


def test_hebo_style_prefixed_names_load(tmp_path):
    """A checkpoint whose weights carry a wrapper prefix (model./draft_model.) maps onto ours."""
    from safetensors.torch import load_file, save_file

    target, draft = tiny_pair(tli=0, seed=6)
    draft.save(tmp_path / "ck", dtype=torch.float32)
    st = load_file(str(tmp_path / "ck" / "model.safetensors"))
    save_file(
        {("model." + k): v for k, v in st.items()} | {"model.embed_tokens.weight": torch.zeros(VOCAB, 32)},
        str(tmp_path / "ck" / "model.safetensors"),
    )
    loaded = load_moa(tmp_path / "ck", target.cfg)
    assert all(torch.equal(a, b) for a, b in zip(draft.state_dict().values(), loaded.state_dict().values()))


# --- training == inference ---------------------------------------------------------------------
@pytest.mark.parametrize("tli,memory", [(0, "lsa"), (1, "lsa"), (0, "last_hidden")])
def test_training_forward_matches_the_drafter_chain(tli, memory):
    """With one verification point at the last prompt token, training rows v+1, v+2, .. equal the
    drafter's root and chain nodes (SA staircase == 'self', CA up to v, TLI real/draft K/V)."""
    target, draft = tiny_pair(tli=tli, seed=7, draft_vocab=0, memory=memory)
    drafter = MoADrafter(target.model, draft)
    eng = Engine(target, drafter, EngineConfig(tree=TreeShape.chain(4)))
    prompt = _prompts(1, 9)[0][:MEMORY_TOKENS]  # (memory for every prompt token, as training's CA sees)
    recorded = []
    head = drafter._to_logits
    drafter._to_logits = lambda h, full: recorded.append(head(h, full)) or recorded[-1]
    req, tree = _one_propose(drafter, eng, prompt, TreeShape.chain(4))
    seq = torch.tensor(req.token_ids + tree.draft_tokens[1:].tolist())
    v_pt = len(prompt) - 1
    batch = Batch(seq[None], torch.ones(1, len(seq), dtype=torch.bool), torch.tensor([len(seq)]))
    task = MoATask(target.model, draft, autocast=False)
    tout = TargetRunner(target.model, 64).run(batch, task.capture_layers)
    v = torch.where(torch.arange(len(seq)) > v_pt, v_pt, 0)[None]
    with torch.no_grad():
        hidden, _ = task.forward(batch, tout, v, torch.tensor([True]))
        from sglang_ext.models.llama import rms_norm

        z = rms_norm(hidden[0], target.model.norm, target.cfg.rms_norm_eps) @ target.model.lm_head.T
    for d in range(4):
        assert torch.allclose(z[v_pt + 1 + d], recorded[d].reshape(-1, VOCAB)[0], atol=1e-4), f"depth {d}"


# --- greedy identity ---------------------------------------------------------------------------
@pytest.mark.parametrize("tli", [0, 1])
@pytest.mark.parametrize(
    "shape",
    [TreeShape.chain(4), TreeShape(4, 3, 10), TreeShape(4, 3, 10, min_prob=0.02)],
    ids=["chain4", "tree4x3x10", "tree4x3x10-min-prob"],
)
@pytest.mark.parametrize("bs", [1, 4])
def test_greedy_identity_tiny(tli, shape, bs):
    target, draft = tiny_pair(tli=tli, seed=2)
    prompts = _prompts(4, bs)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ref = [r.output_ids for r in Engine(target, None).generate(prompts, params)]
    drafter = MoADrafter(target.model, draft)
    eng = Engine(target, drafter, EngineConfig(tree=shape))
    outs = []
    for i in range(0, len(prompts), bs):
        outs += [r.output_ids for r in eng.generate(prompts[i : i + bs], params)]
    verdicts = [compare_to_reference(target.model, p, r, o) for p, r, o in zip(prompts, ref, outs)]
    assert "bug" not in verdicts, verdicts
    assert slots_whole(eng) and drafter_pools_whole(drafter) and not drafter.reqs


@pytest.mark.parametrize("tli", [0, 1])
def test_one_drafter_serves_a_new_kv_pool_once_the_old_ones_requests_are_gone(tli):
    """A second engine with the same drafter, and an engine whose reset rebuilt its KV pool (slots leaked
    by a fault): the drafter binds the new pool and keeps drafting, greedy tokens unchanged; while a
    request of the old pool is live, a request of another pool is refused (it would read the wrong K/V)."""
    target, draft = tiny_pair(tli=tli, seed=4)
    prompts, params = _prompts(2, 9), SamplingParams(max_new_tokens=16, ignore_eos=True)
    ref = [r.output_ids for r in Engine(target, None).generate(prompts, params)]
    drafter = MoADrafter(target.model, draft)
    shape = TreeShape(3, 2, 6)
    first, second = Engine(target, drafter, EngineConfig(tree=shape)), Engine(target, drafter, EngineConfig(tree=shape))
    fallbacks = []
    for eng in (first, second):
        eng.on_fallback = lambda r, why: fallbacks.append(why)
    for eng in (first, second, first):
        reqs = eng.generate(prompts, params)
        assert [r.output_ids for r in reqs] == ref and not fallbacks
        assert sum(r.stats.draft_tokens for r in reqs) > 0
    first.kv.alloc(3)  # slots no request holds: reset() rebuilds the pool
    first.reset()
    assert [r.output_ids for r in first.generate(prompts[:1], params)] == ref[:1]
    assert drafter.tli_kv is first.kv

    live = first.add_request(prompts[0], params)
    first.step()  # its prefill: the drafter holds its state
    assert second.generate(prompts[1:], params)[0].output_ids == ref[1]  # (vanilla decoding after the refusal)
    assert fallbacks == ["DrafterError"]
    first.abort(live)


@pytest.mark.parametrize("shape", [TreeShape.chain(3), TreeShape(3, 2, 6)], ids=["sampled-chain", "tree"])
def test_sampling_runs_and_drafts_stay_in_vocab(shape):
    target, draft = tiny_pair(tli=1, seed=4)
    eng = Engine(target, MoADrafter(target.model, draft), EngineConfig(tree=shape))
    falls = []
    eng.on_fallback = lambda r, reason: falls.append(reason)
    reqs = eng.generate(
        [[1, 2, 3, 4], [5, 6, 7]], SamplingParams(max_new_tokens=16, temperature=1.0, seed=0, ignore_eos=True)
    )
    assert not falls and all(len(r.output_ids) == 16 for r in reqs)
    assert all(r.stats.draft_tokens > 0 for r in reqs)


@pytest.mark.parametrize("memory", ["lsa", "last_hidden"])
def test_drafter_by_path_and_ancestors_mode(tmp_path, memory):
    target, draft = tiny_pair(tli=1, seed=5, sa="ancestors", memory=memory)
    draft.save(tmp_path / "ck", dtype=torch.float32)
    drafter = make_drafter(str(tmp_path / "ck"), target)
    assert isinstance(drafter, MoADrafter) and drafter.cfg.sa_tree_attention == "ancestors"
    prompts = _prompts(2, 11)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    ref = [r.output_ids for r in Engine(target, None).generate(prompts, params)]
    outs = [
        r.output_ids for r in Engine(target, drafter, EngineConfig(tree=TreeShape(3, 2, 6))).generate(prompts, params)
    ]
    assert "bug" not in [compare_to_reference(target.model, p, r, o) for p, r, o in zip(prompts, ref, outs)]


# --- a short training run ----------------------------------------------------------------------
@pytest.mark.parametrize("tli", [0, 1])
def test_short_training_run_lowers_loss(tmp_path, tli):
    cfg = tiny_config(vocab=VOCAB, layers=LAYERS)
    target = LlamaModel(cfg, tiny_state(cfg, 0))
    torch.manual_seed(0)
    draft = MoADraft(MoAConfig.for_target(cfg, tli=tli))
    g = torch.Generator().manual_seed(0)
    exs = []
    for _ in range(8):  # repetitive sequences: learnable in a few steps
        ids = torch.randint(0, VOCAB, (6,), generator=g).repeat(5)
        exs.append(Example(ids, torch.arange(ids.numel()) >= 4))
    task = MoATask(target, draft, min_gap=2, max_gap=4, seed=0)
    batches = make_batches(exs, 64, seed=0)
    trainer = Trainer(
        task,
        TargetRunner(target, 64),
        batches,
        OptimConfig(lr=1e-2, warmup_ratio=0.1),
        RunConfig(str(tmp_path), 40, save_every_s=1e9, progress_bar=False),
    )

    def evaluate():
        with torch.no_grad():
            ms = [task.loss(b, trainer.runner.run(b, task.capture_layers), 1.0)[1] for b in batches]
        return {k: sum(m[k] for m in ms) / len(ms) for k in ("loss", "kl", "feat", "acc")}

    before = evaluate()
    final = trainer.fit()
    after = evaluate()
    # the tiny target's hidden states are large, so the feature term moves slowly; the KL must fall a lot
    assert after["loss"] < before["loss"] and after["feat"] < before["feat"], (before, after)
    assert after["kl"] < 0.6 * before["kl"] and after["acc"] > before["acc"] + 0.1, (before, after)
    assert {"kl", "feat", "acc", "acc_0", "grad_norm"} <= set(final)
    ckpt = tmp_path / "checkpoints" / (tmp_path / "latest").read_text().strip()
    assert load_moa(ckpt, cfg).cfg.tli == tli


@pytest.mark.slow
@pytest.mark.parametrize("name", ["moa-tli0", "moa-tli1"])
@pytest.mark.parametrize("bs", [1, 4])
def test_greedy_identity_smollm2(smollm2_fp32, eval_prompts, name, bs):
    """SmolLM2 fp32 with the shipped MoA drafter (a random one with the same TLI if none is shipped)."""
    from sglang_ext.drafters.moa import shipped_checkpoint

    try:
        draft = load_moa(shipped_checkpoint(smollm2_fp32, name), smollm2_fp32.cfg)
    except CheckpointError:
        draft = MoADraft(MoAConfig.for_target(smollm2_fp32.cfg, tli=int(name[-1])))
    prompts = eval_prompts[:8]
    params = SamplingParams(max_new_tokens=32)
    ref = [r.output_ids for r in Engine(smollm2_fp32, None).generate(prompts, params)]
    eng = Engine(smollm2_fp32, MoADrafter(smollm2_fp32.model, draft), EngineConfig(tree=TreeShape(5, 4, 16)))
    reqs = []
    for i in range(0, len(prompts), bs):
        reqs += eng.generate(prompts[i : i + bs], params)
    verdicts = [compare_to_reference(smollm2_fp32.model, p, r, q.output_ids) for p, r, q in zip(prompts, ref, reqs)]
    print(
        f"{name} bs{bs}: {verdicts.count('same')} same, {verdicts.count('tie')} ties; tau "
        f"{sum(q.stats.accept_length for q in reqs) / len(reqs):.2f}"
    )
    assert "bug" not in verdicts, verdicts


def test_lsa_layer_rope_is_made_once_and_matches_a_fresh_one():
    from sglang_ext.models.llama import rope_of

    _, d = tiny_pair()
    a = d._lsa_rope(5, torch.float32, torch.device("cpu"))
    assert d._lsa_rope(5, torch.float32, torch.device("cpu")) is a  # cached, not recomputed per token
    fresh = rope_of(d.lsa_inv_freq, torch.arange(5), torch.float32)
    assert torch.equal(a[0], fresh[0]) and torch.equal(a[1], fresh[1])
    b = d._lsa_rope(7, torch.float32, torch.device("cpu"))
    assert b[0].shape[0] == 7  # another layer count: its own entry


def test_moa_draft_math_has_one_home():
    """The MoA pieces (LSA, SA, CA) and the logits/top-k step are driven from drafters/moa_core.py and
    search.py only: the embedded drafter and the SGLang plugin's draft core are storage around them."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "sglang_ext"
    math = re.compile(r"\.(lsa|sa_qkv|sa_finish|ca_kv|ca_q|ca_finish|topk)\(|softmax\(|\blinear\(")
    storage = [root / "drafters" / "moa.py", *sorted((root / "sglang_plugin").rglob("*.py"))]
    hits = [f"{p.name}: {line.strip()}" for p in storage for line in p.read_text().splitlines() if math.search(line)]
    assert not hits, hits


@pytest.mark.parametrize("tli", [0, 1])
def test_a_batch_flush_leaves_each_request_the_state_it_gets_alone(tli):
    """The batch's verified tokens go through one LSA, one SA commit and one write per pool; each
    request's slot lists and memory / SA K/V equal what it gets flushed alone."""
    from sglang_ext.drafters.base import TargetCapture

    target, draft = tiny_pair(tli=tli, seed=4)
    together, alone = MoADrafter(target.model, draft), MoADrafter(target.model, draft)
    kv = target.model.new_kv_pool(128)
    g = torch.Generator().manual_seed(0)
    for k, v in zip(kv.k, kv.v):
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    tokens = _prompts(3, 1)
    slots = iter(range(1, 128))

    def capture(ids, start):
        n = len(ids)
        return TargetCapture(ids, torch.arange(start, start + n), torch.tensor([next(slots) for _ in ids]), {}, kv)

    def check(batch):
        together._flush(batch)
        for d in batch:
            alone._flush([d])
            a, b = together.reqs[d.rid], alone.reqs[d.rid]
            assert torch.equal(a.target_slots, b.target_slots) and not a.pending
            for pool, x, y in ((together.mem, a.mem_slots, b.mem_slots), (together.sa, a.sa_slots, b.sa_slots)):
                other = alone.mem if pool is together.mem else alone.sa
                torch.testing.assert_close(pool.k[0][x], other.k[0][y], rtol=0, atol=1e-6)
                torch.testing.assert_close(pool.v[0][x], other.v[0][y], rtol=0, atol=1e-6)

    together_and_alone(together, alone, tokens, capture, check)


def test_a_catch_up_after_drafting_was_off_gives_memory_to_the_last_commits_only():
    """Off for 20 steps (a commit of one token each), then drafting: LSA runs over the last CATCH_UP_COMMITS
    commits' tokens, not all 20; the rest get no memory (CA never reads them), SA and TLI still see every token;
    the output is vanilla's; at the end the request's tokens are kept beside the prefix cache (those in the hole
    without memory) and every other slot of the drafter's pools goes back."""
    target, draft = tiny_pair(tli=1, seed=5)
    drafter = MoADrafter(target.model, draft)
    rows = []
    lsa = drafter.draft.lsa
    drafter.draft.lsa = lambda x: rows.append(x.shape[0]) or lsa(x)
    free = (drafter.mem.num_free, drafter.sa.num_free)
    eng = Engine(target, drafter, EngineConfig(tree=TreeShape(2, 2, 4)))
    eng.policy = scripted_policy(eng.tree, range(2, 22))
    prompt = _prompts(1, 7)[0][:MEMORY_TOKENS]  # (memory for every prompt token: the catch-up's hole is the only one)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    req = eng.add_request(prompt, params)
    while eng.policy.calls < 22:
        eng.step()
    st = drafter.reqs[req.rid]
    assert rows[:2] == [len(prompt), CATCH_UP_COMMITS]  # the prompt; then the last 8 of 21 commits (one token each)
    queued = st.target_slots.numel() - len(prompt)  # tokens committed after the prompt, caught up at step 22
    assert st.holes == [(len(prompt), len(prompt) + queued - CATCH_UP_COMMITS)]
    assert st.sa_slots.numel() == st.target_slots.numel() == st.mem_slots.numel() + queued - CATCH_UP_COMMITS
    assert (st.memory_of_tokens() < 0).sum() == queued - CATCH_UP_COMMITS
    while not req.finished:
        eng.step()
    vanilla = Engine(target, None, EngineConfig()).generate([prompt], params)[0]
    assert req.output_ids == vanilla.output_ids
    kept = drafter.kept
    assert len(kept) > st.holes[0][1] and kept.held(1) == len(kept) and kept.held(0) < len(kept)  # (past the hole)
    assert (drafter.mem.num_free + kept.held(0), drafter.sa.num_free + kept.held(1)) == free


def test_a_long_prompt_gets_memory_for_its_last_tokens_only():
    """A prompt longer than MEMORY_TOKENS: LSA runs over its last MEMORY_TOKENS tokens (CA's memory), SA and the TLI
    layer see all of it; then each step's verified tokens as ever; the output is vanilla's. A second request on the
    same prompt adopts every kept token (SA all, memory where the first had it) and runs no LSA over the prompt."""
    target, draft = tiny_pair(tli=1, seed=9)
    drafter = MoADrafter(target.model, draft)
    rows = []
    lsa = drafter.draft.lsa
    drafter.draft.lsa = lambda x: rows.append(x.shape[0]) or lsa(x)
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, VOCAB, (MEMORY_TOKENS + 37,), generator=g).tolist()
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    eng = Engine(target, drafter, EngineConfig(tree=TreeShape(2, 2, 4), adaptive=False))
    req = eng.add_request(prompt, params)
    eng.step()
    eng.step()
    assert rows == [MEMORY_TOKENS] and drafter.reqs[req.rid].holes == [(0, 37)]
    while not req.finished:
        eng.step()
    assert all(r <= 3 for r in rows[1:])  # (each step's accepted tokens)
    assert req.output_ids == Engine(target, None, EngineConfig()).generate([prompt], params)[0].output_ids
    rows.clear()
    again = eng.add_request(prompt, params)
    eng.step()
    st = drafter.reqs[again.rid]
    assert st.borrowed == len(prompt) - 1 and st.holes == [(0, 37)] and rows == []  # (its last token: prefilled)
    eng.step()
    assert rows[0] == 1  # (that token, with the first step's verified ones after it)


def test_a_request_that_never_drafted_catches_up_on_its_last_commits_not_its_prompt():
    """Off from a request's first decode step for 20 steps: its first draft gives memory to the last
    CATCH_UP_COMMITS commits' tokens only (its prompt is a commit older than those: no LSA over it)."""
    target, draft = tiny_pair(tli=0, seed=6)
    drafter = MoADrafter(target.model, draft)
    rows = []
    lsa = drafter.draft.lsa
    drafter.draft.lsa = lambda x: rows.append(x.shape[0]) or lsa(x)
    eng = Engine(target, drafter, EngineConfig(tree=TreeShape(2, 2, 4)))
    eng.policy = scripted_policy(eng.tree, range(1, 21))
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    prompt = _prompts(1, 8)[0]
    req = eng.add_request(prompt, params)
    while eng.policy.calls < 21:
        eng.step()
    st = drafter.reqs[req.rid]
    assert rows == [CATCH_UP_COMMITS] and st.holes[0][0] == 0 and st.mem_slots.numel() == CATCH_UP_COMMITS
    while not req.finished:
        eng.step()
    assert req.output_ids == Engine(target, None, EngineConfig()).generate([prompt], params)[0].output_ids


class _Committing(MoADrafter):
    """MoA committed on every step, off steps included (what the engine did before drafters caught up)."""

    catches_up = False


def test_off_steps_commit_nothing_and_the_catch_up_leaves_the_state_of_committing_every_step():
    """A MoA drafter `catches_up`: the engine builds no commit on a step that drafts nothing (speculation off), and
    the drafter takes those tokens from the request at its next propose. Two requests, off in stretches (one
    reaching past the catch-up's memory window): no commit on an off step; the same trees, tokens and, after each
    catch-up, the same state (target slots, holes without memory, memory and SA K/V) as a drafter committed on
    every step; the output is vanilla's."""
    target, draft = tiny_pair(tli=1, seed=11)
    prompts, params = _prompts(2, 12), SamplingParams(max_new_tokens=48, ignore_eos=True)
    off = {*range(3, 6), *range(9, 25), *range(30, 32)}
    runs = {}
    for cls in (MoADrafter, _Committing):
        drafter, states = cls(target.model, draft), []

        def after(reqs, drafter=drafter, states=states):  # (the state after a drafted step's propose)
            states.append({r.rid: _state_of(drafter, r.rid) for r in reqs if r.rid in drafter.reqs})

        runs[cls] = (*off_stretches_run(target, drafter, prompts, params, off, TreeShape(2, 2, 4), after), states)
    (steps, drafted, out, states), (ref_steps, ref_drafted, ref_out, ref_states) = runs[MoADrafter], runs[_Committing]
    assert all(k == 0 for call, k in steps if call in off) and all(k == 2 for call, k in ref_steps if call in off)
    assert drafted == ref_drafted and len(drafted) > 20 and out == ref_out
    assert len(states) == len(ref_states)
    for got, want in zip(states, ref_states):
        assert got.keys() == want.keys()
        for rid in got:
            for x, y in zip(got[rid], want[rid]):
                if torch.is_tensor(x):
                    torch.testing.assert_close(x, y, rtol=0, atol=0)
                else:
                    assert x == y
    assert any(st[4] for s in states for st in s.values())  # (a catch-up left tokens without memory)
    assert out == [r.output_ids for r in Engine(target, None).generate(prompts, params)]


def _state_of(drafter: MoADrafter, rid: int) -> tuple:
    """A request's MoA state: its verified tokens' target slots, the memory and SA K/V they have, its holes."""
    st = drafter.reqs[rid]
    has = st.memory_of_tokens()
    mem = has[has >= 0]
    return (
        st.target_slots,
        torch.cat([drafter.mem.k[0][mem], drafter.mem.v[0][mem]]),
        torch.cat([drafter.sa.k[0][st.sa_slots], drafter.sa.v[0][st.sa_slots]]),
        len(st.pending),
        list(st.holes),
    )
