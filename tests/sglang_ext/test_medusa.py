"""Medusa heads: init, the loss's indexing, trees from the heads, checkpoints, a training run on a tiny
target, greedy identity with the shipped heads on the real SmolLM2, and the sampled law (chi-square)."""

from __future__ import annotations

import heapq
import json
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    alone_or_batched,
    compare_to_reference,
    generate_in_groups,
    slots_whole,
    tiny_config,
    tiny_state,
    tiny_target,
)
from test_distribution import PROMPT, SAMPLES, chi2_pvalue, exact_joint_t2_t3

from serving.config import EngineConfig
from serving.engine import Engine
from sglang_ext.attention import causal_mask, plan_attention
from sglang_ext.drafters import default_tree, drafter_kind, make_drafter
from sglang_ext.drafters.base import DrafterError, DraftInput, TargetCapture
from sglang_ext.drafters.medusa import MedusaDrafter, head_trees
from sglang_ext.models import LlamaModel
from sglang_ext.models.checkpoint import MEDUSA, CheckpointError, checkpoint_kind
from sglang_ext.models.medusa import MedusaConfig, MedusaHeads, load_medusa
from sglang_ext.sampling import SamplingParams
from sglang_ext.training.data import Batch, Example, make_batches
from sglang_ext.training.medusa import MedusaTask, head_labels
from sglang_ext.training.target import TargetOutputs, TargetRunner
from sglang_ext.training.trainer import OptimConfig, RunConfig, Trainer
from sglang_ext.tree import TreeShape

NEW_TOKENS = 20
SHAPES = {"chain": TreeShape.chain(3), "tree": TreeShape(4, 3, 10)}


def _random_heads(cfg: MedusaConfig, seed: int = 0, scale: float = 0.3) -> MedusaHeads:
    heads = MedusaHeads(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return heads


def _prompt_capture(model: LlamaModel, ids: list[int], layer: int) -> tuple[TargetCapture, torch.Tensor]:
    """The target's prefill of ids: the capture a drafter gets, and the logits at the last position [V]."""
    kv = model.new_kv_pool(len(ids) + 1)
    s = kv.alloc(len(ids))
    out = model.forward(
        torch.tensor(ids), torch.arange(len(ids)), s, plan_attention([s], [causal_mask(len(ids), 0)]), kv, (layer,)
    )
    cap = TargetCapture(list(ids), torch.arange(len(ids)), s, {layer: out.captured[layer]}, kv)
    return cap, model.logits(out.hidden[-1:])[0]


# --- heads ------------------------------------------------------------------------------------
def test_zero_init_heads_are_the_targets_own_prediction():
    target = tiny_target(seed=1, vocab=16)
    cfg = MedusaConfig.for_target(target.cfg, num_heads=3, draft_vocab_size=0)
    heads = MedusaHeads(cfg)
    assert cfg.draft_vocab_size == 16 and all(
        not p.detach().any() for n, p in heads.named_parameters() if "linear" in n
    )
    h = torch.randn(5, 7, target.cfg.hidden_size)
    out = heads(h)
    assert out.shape == (5, 7, 3, target.cfg.hidden_size) and torch.equal(out, h[:, :, None].expand_as(out))
    z = heads.logits(h, target.model.lm_head)
    assert z.shape == (5, 7, 3, 16)
    assert torch.equal(z.argmax(-1), F.linear(h, target.model.lm_head).argmax(-1)[..., None].expand(5, 7, 3))
    # the drafter reads the last verified token's hidden state: zero-init heads put the target's next token at depth 1
    drafter = MedusaDrafter(target.model, heads)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    cap, last_logits = _prompt_capture(target.model, prompt, target.cfg.num_layers - 1)
    drafter.add_request(0, cap)
    nxt = int(last_logits.argmax())
    tree = drafter.propose([DraftInput(0, prompt + [nxt], SamplingParams(), None)], TreeShape.chain(3))[0]
    assert tree.draft_tokens.tolist() == [nxt] * 4  # every head is the target's next-token prediction at init
    assert tree.positions.tolist() == [8, 9, 10, 11] and tree.draft_probs is None


def test_config_checks_and_vocab():
    cfg = MedusaConfig.for_target(tiny_config(vocab=32), num_heads=2, draft_vocab_size=8)
    heads = MedusaHeads(cfg)
    heads.set_vocab(torch.tensor([31, 2, 5, 7, 11, 13, 17, 19]))
    assert heads.hot_ids.tolist() == [2, 5, 7, 11, 13, 17, 19, 31]
    t2d = heads.target_to_draft()
    assert t2d[31] == 7 and t2d[2] == 0 and t2d[3] == -1
    with pytest.raises(ValueError, match="distinct"):
        heads.set_vocab(torch.tensor([1, 1, 2, 3, 4, 5, 6, 7]))
    with pytest.raises(ValueError, match="outside the target vocab"):
        heads.set_vocab(torch.tensor([1, 2, 3, 4, 5, 6, 7, 40]))
    with pytest.raises(CheckpointError, match="draft_vocab_size"):
        MedusaConfig(32, 32, 64)
    with pytest.raises(CheckpointError, match=">= 1 head"):
        MedusaConfig(32, 32, 32, num_heads=0)


# --- the loss's indexing ----------------------------------------------------------------------
def test_head_labels_are_k_plus_2_ahead_within_length_and_mask():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]], dtype=torch.bool)
    batch = Batch(ids, mask, torch.tensor([6, 4]))
    labels, counts = head_labels(batch, 0)  # head 0 at row u -> x_{u+2}
    assert labels[0, :4].tolist() == [12, 13, 14, 15] and labels[1, :2].tolist() == [22, 23]
    assert counts.tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]]
    labels, counts = head_labels(batch, 2)  # head 2 -> x_{u+4}
    assert labels[0, :2].tolist() == [14, 15] and counts.tolist() == [[1, 1, 0, 0, 0, 0], [0] * 6]


def test_loss_scores_each_head_against_the_right_token():
    target = tiny_target(seed=2, vocab=16)
    cfg = MedusaConfig.for_target(target.cfg, num_heads=3, draft_vocab_size=12)
    heads = _random_heads(cfg, seed=4)
    heads.set_vocab(torch.arange(2, 14))  # ids 0, 1, 14, 15 are outside the draft vocab
    task = MedusaTask(target.model, heads, decay=0.8, autocast=False)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 16, (2, 9), generator=g)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    lengths = torch.tensor([9, 6])
    batch = Batch(ids, mask, lengths)
    hidden = torch.randn(2, 9, target.cfg.hidden_size, generator=g)
    tout = TargetOutputs(hidden, {}, [], [], torch.zeros(2, 9, dtype=torch.long))
    total, metrics = task.loss(batch, tout, 0.0)
    rows = target.model.lm_head[heads.hot_ids]
    expect_total = 0.0
    for k in range(3):
        ce_sum, hits, n = 0.0, 0, 0
        for b in range(2):
            for u in range(int(lengths[b])):
                v = u + k + 2
                if v >= int(lengths[b]) or not mask[b, v]:
                    continue
                n += 1
                tok = int(ids[b, v])
                if not 2 <= tok < 14:
                    continue  # outside the draft vocab: a miss, no CE term
                z = F.linear(heads.medusa_head[k](hidden[b, u]), rows)
                ce_sum += float(F.cross_entropy(z[None], torch.tensor([tok - 2])))
                hits += int(z.argmax()) == tok - 2
        assert float(metrics[f"loss_{k}"]) == pytest.approx(ce_sum / n, rel=1e-5)
        assert float(metrics[f"acc_{k}"]) == pytest.approx(hits / n)
        expect_total += 0.8**k * ce_sum / n
    assert float(total) == pytest.approx(expect_total, rel=1e-5)


# --- trees ------------------------------------------------------------------------------------
def best_first_tree(
    probs: list[list[float]], ids: list[list[int]], num_nodes: int, min_prob: float = 0.0
) -> tuple[list[int], list[int]]:
    """The reference rule, on the host: the best nodes of the tree whose depth-(d+1) children are ids[d]
    with probabilities probs[d].

    probs, ids: [depth][topk] per depth, best first. Returns (tokens, parents) of the non-root nodes
    in the order taken (parents index the full tree: 0 = the root, node i of the result = i + 1),
    at most num_nodes of them, each of path probability >= min_prob.
    """
    tokens: list[int] = []
    parents: list[int] = []
    # (-score, tie order, depth index d, parent node, token)
    heap = [(-p, j, 0, 0, t) for j, (p, t) in enumerate(zip(probs[0], ids[0]))]
    heapq.heapify(heap)
    order = len(heap)
    while heap and len(tokens) < num_nodes:
        neg, _, d, parent, tok = heapq.heappop(heap)
        score = -neg
        if score < min_prob or score <= 0.0:
            break  # the heap pops in decreasing score: everything left is lower
        tokens.append(tok)
        parents.append(parent)
        node = len(tokens)
        if d + 1 < len(probs):
            for p, t in zip(probs[d + 1], ids[d + 1]):
                heapq.heappush(heap, (-score * p, order, d + 1, node, t))
                order += 1
    return tokens, parents


def _node_paths(tokens: list[int], parents: list[int]) -> set[tuple[int, ...]]:
    """best_first_tree's nodes as token paths from the root (root excluded)."""
    paths = [()]
    for tok, par in zip(tokens, parents):
        paths.append(paths[par] + (tok,))
    return set(paths[1:])


def _tree_paths(tree, reachable: bool = False) -> set[tuple[int, ...]]:
    """A TokenTree's nodes as token paths (with reachable: only those verification can reach)."""
    toks, pars = tree.draft_tokens.tolist(), tree.parents.tolist()
    linked = [True] * len(toks)
    if reachable:
        heads = set(tree.retrieve_next_token.tolist()) | set(tree.retrieve_next_sibling.tolist())
        linked = [i == 0 or (i in heads and linked[pars[i]]) for i in range(len(toks))]
    out = set()
    for i in range(1, len(toks)):
        if linked[i]:
            path, n = [], i
            while n > 0:
                path.append(toks[n])
                n = pars[n]
            out.add(tuple(path[::-1]))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_head_trees_on_the_device_are_the_best_first_trees(seed):
    """The batched, read-free tree builder keeps exactly the best-first nodes (random head
    probabilities: no ties), with and without min_prob, dropped (CPU) or unlinked (a device's rule)."""
    g = torch.Generator().manual_seed(seed)
    b, depth, k = 3, 1 + seed % 4, 2 + seed % 3
    top_p = torch.rand(b, depth, k, generator=g).sort(dim=-1, descending=True).values
    top_ids = torch.randperm(1000, generator=g)[: b * depth * k].view(b, depth, k)
    n = 2 + seed * 3 % 12
    most = sum(k ** (t + 1) for t in range(depth))
    for min_prob in (0.0, 0.05, 0.3):
        dropped = head_trees(top_p, top_ids, torch.tensor([7, 8, 9]), [4, 5, 6], n, min_prob)
        kept = head_trees(top_p, top_ids, torch.tensor([7, 8, 9]), [4, 5, 6], n, min_prob, drop=False)
        for i in range(b):
            want = _node_paths(*best_first_tree(top_p[i].tolist(), top_ids[i].tolist(), n - 1, min_prob))
            assert _tree_paths(dropped[i]) == want and _tree_paths(kept[i], reachable=True) == want
            assert kept[i].num_nodes == min(n, most + 1) and dropped[i].draft_tokens[0] == 7 + i
            assert (dropped[i].scores[1:] >= min_prob).all()


def test_best_first_tree_keeps_the_best_paths_closed_under_parents():
    probs = [[0.6, 0.3], [0.9, 0.05], [0.45, 0.4]]
    ids = [[1, 2], [3, 4], [5, 6]]
    tokens, parents = best_first_tree(probs, ids, 5)
    # path scores: 1 .6, 1-3 .54, 2 .3, 2-3 .27, 1-3-5 .243, 1-3-6 .216, 1-4 .03
    assert tokens == [1, 3, 2, 3, 5] and parents == [0, 1, 0, 3, 2]
    assert best_first_tree(probs, ids, 10, min_prob=0.28) == ([1, 3, 2], [0, 1, 0])
    assert best_first_tree(probs[:1], ids[:1], 10) == ([1, 2], [0, 0])  # depth 1: the root's children only
    assert best_first_tree([[0.7]], [[9]], 1) == ([9], [0])


def test_drafter_trees_respect_the_shape():
    target = tiny_target(seed=5, vocab=16)
    heads = _random_heads(MedusaConfig.for_target(target.cfg, num_heads=3, draft_vocab_size=0), seed=1)
    drafter = MedusaDrafter(target.model, heads)
    prompt = [1, 2, 3, 4, 5]
    cap, _ = _prompt_capture(target.model, prompt, target.cfg.num_layers - 1)
    drafter.add_request(7, cap)
    probs = drafter.head_probs([7])[0]  # [K, V]
    for shape in [TreeShape(2, 2, 5), TreeShape(5, 3, 12), TreeShape(3, 4, 9, min_prob=0.05), TreeShape.chain(2)]:
        t = drafter.propose([DraftInput(7, prompt + [6], SamplingParams(), None)], shape)[0]
        depth = t.tree_mask.sum(1) - 1
        assert 2 <= t.num_nodes <= shape.num_draft_tokens and int(t.draft_tokens[0]) == 6
        assert int(depth.max()) <= min(shape.depth, 3)  # at most K heads deep
        assert torch.equal(t.positions, depth + len(prompt))
        for node in range(1, t.num_nodes):
            d = int(depth[node])  # head d-1 proposes depth d, from its top-k
            top = probs[d - 1].topk(shape.topk).indices.tolist()
            assert int(t.draft_tokens[node]) in top
            path = t.path_to(node)[1:]
            score = math.prod(float(probs[int(depth[n]) - 1, int(t.draft_tokens[n])]) for n in path)
            assert score >= shape.min_prob
        assert max(int((t.parents == p).sum()) for p in range(t.num_nodes)) <= shape.topk
    drafter.remove_request(7)
    with pytest.raises(DrafterError, match="no verified hidden state"):
        drafter.propose([DraftInput(7, prompt + [6], SamplingParams(), None)], TreeShape.chain(2))
    with pytest.raises(DrafterError, match="lacks the output of layer"):
        drafter.add_request(8, TargetCapture([1], torch.arange(1), torch.arange(1)))


# --- checkpoints ------------------------------------------------------------------------------
def test_checkpoint_round_trip_and_bad_checkpoints(tmp_path):
    tcfg = tiny_config(vocab=32)
    heads = _random_heads(MedusaConfig.for_target(tcfg, num_heads=2, draft_vocab_size=8), seed=3)
    heads.set_vocab(torch.tensor([0, 3, 6, 9, 12, 15, 18, 31]))
    heads.save(tmp_path / "m", extra_config={"training": {"step": 3}})
    assert checkpoint_kind(tmp_path / "m") == MEDUSA and drafter_kind(str(tmp_path / "m")) == "medusa"
    back = load_medusa(tmp_path / "m", tcfg)
    assert back.cfg == heads.cfg and torch.equal(back.hot_ids, heads.hot_ids)
    for (name, a), b in zip(heads.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a.to(torch.bfloat16).to(a.dtype), b), name  # saved in bf16
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["training"] == {"step": 3} and cfg["architectures"] == ["MedusaHeads"]

    with pytest.raises(CheckpointError, match="Medusa draft does not fit.*hidden_size 32 != target's hidden_size 64"):
        load_medusa(tmp_path / "m", tiny_config(vocab=32, hidden=64))
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_medusa(tmp_path / "nothing")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps(cfg | {"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(CheckpointError, match="not a Medusa checkpoint"):
        load_medusa(tmp_path / "other")
    (tmp_path / "other" / "config.json").write_text(json.dumps(cfg | {"shared_lm_head": False}))
    with pytest.raises(CheckpointError, match="shared_lm_head"):
        load_medusa(tmp_path / "other")
    (tmp_path / "other" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_medusa(tmp_path / "other")
    # a checkpoint with a head of its own (the paper's per-head lm_head): refused by name
    own = {k: v for k, v in heads.state_dict().items()} | {"medusa_head.0.1.weight": torch.zeros(32, 32)}
    from sglang_ext.models.checkpoint import save_weights

    save_weights(own, tmp_path / "other")
    with pytest.raises(CheckpointError, match=r"unexpected weights \['medusa_head.0.1.weight'\]"):
        load_medusa(tmp_path / "other")
    save_weights({**heads.state_dict(), "hot_ids": heads.hot_ids.flip(0)}, tmp_path / "other")
    with pytest.raises(CheckpointError, match="hot_ids must be sorted"):
        load_medusa(tmp_path / "other")


# --- training ---------------------------------------------------------------------------------
def test_short_training_run_lowers_the_loss_and_exports(tmp_path):
    cfg = tiny_config(vocab=64, layers=4)
    target = LlamaModel(cfg, tiny_state(cfg, 0))
    heads = MedusaHeads(MedusaConfig.for_target(cfg, num_heads=3, draft_vocab_size=0))
    g = torch.Generator().manual_seed(0)
    exs = []
    for _ in range(8):  # repetitive sequences: the token k+2 ahead is learnable in a few steps
        ids = torch.randint(0, 64, (6,), generator=g).repeat(5)
        exs.append(Example(ids, torch.arange(ids.numel()) >= 4))
    batches = make_batches(exs, 64, seed=0)
    task = MedusaTask(target, heads, autocast=False)
    trainer = Trainer(
        task,
        TargetRunner(target, 64),
        batches,
        OptimConfig(lr=3e-2, warmup_ratio=0.1),
        RunConfig(str(tmp_path), 60, save_every_s=1e9, progress_bar=False),
    )

    def eval_loss():
        with torch.no_grad():
            return sum(float(task.loss(b, trainer.runner.run(b, (), keep_kv=False), 0.0)[0]) for b in batches)

    before = eval_loss()
    final = trainer.fit()
    after = eval_loss()
    assert after < 0.5 * before, (before, after)
    assert {"loss_0", "acc_0", "loss_2", "acc_2", "grad_norm", "lr"} <= set(final) and final["acc_0"] > 0.5
    ckpt = tmp_path / "checkpoints" / (tmp_path / "latest").read_text().strip()
    assert json.loads((ckpt / "config.json").read_text())["training"]["step"] == 60
    loaded = load_medusa(ckpt, cfg)
    assert torch.equal(loaded.hot_ids, heads.hot_ids)


def test_train_medusa_cli_parses(tmp_path):
    import argparse

    from moa_serve.entrypoints.train import add_train_parser, train_config

    p = argparse.ArgumentParser()
    add_train_parser(p.add_subparsers(dest="command"))
    cfg = train_config(p.parse_args(["train", "medusa", "--data", "x", "--out", str(tmp_path), "--num-heads", "3"]))
    assert (cfg.heads, cfg.medusa.num_heads, cfg.draft_vocab_size, cfg.medusa.decay) == (("medusa",), 3, 8192, 0.8)


def test_train_data_from_a_shard_directory(tmp_path):
    """--data DIR of `moa-serve train pack`: its examples cut into --max-len windows, a seeded sample of them."""
    import numpy as np

    from sglang_ext.training.config import TrainConfig
    from sglang_ext.training.shards import Packed, pack
    from sglang_ext.training.sources import load_sources, split_examples

    g = np.random.default_rng(0)
    items = [Packed(g.integers(0, 50, 30), np.arange(30) >= 10) for _ in range(5)]
    pack(tmp_path / "shards", {"distill:x": iter(items)}, 64)
    cfg = TrainConfig(out=str(tmp_path / "run"), data=(str(tmp_path / "shards"),), num_examples=7, max_len=12)

    def examples():
        return split_examples(load_sources(cfg, None, tmp_path / "run"), cfg)  # shards need no tokenizer

    exs, held = examples()
    assert len(exs) == 7 and not held and all(len(e.input_ids) <= 12 and int(e.loss_mask.sum()) >= 2 for e in exs)
    windows = {tuple(x.ids[s : s + 12].tolist()) for x in items for s in range(0, 30, 12)}
    assert {tuple(e.input_ids.tolist()) for e in exs} <= windows
    assert [e.input_ids.tolist() for e in examples()[0]] == [e.input_ids.tolist() for e in exs]  # the same again


# --- the engine: greedy identity and the sampled law -------------------------------------------
@pytest.fixture(scope="module")
def prompts(eval_prompts):
    return eval_prompts[::3]  # 8 prompts over the six sets


@pytest.fixture(scope="module")
def vanilla_outputs(smollm2_fp32, prompts):
    eng = Engine(smollm2_fp32, None)
    return [r.output_ids for r in eng.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))]


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("bs", [1, 4])
def test_greedy_identity_with_the_shipped_heads(smollm2_fp32, prompts, vanilla_outputs, shape, bs):
    half = alone_or_batched(bs)
    prompts, vanilla_outputs = prompts[half], vanilla_outputs[half]
    eng = Engine(smollm2_fp32, make_drafter("medusa", smollm2_fp32), EngineConfig(tree=SHAPES[shape]))
    outs, accepted = generate_in_groups(eng, prompts, bs, NEW_TOKENS)
    verdicts = [compare_to_reference(smollm2_fp32.model, p, r, o) for p, r, o in zip(prompts, vanilla_outputs, outs)]
    assert "bug" not in verdicts, f"medusa/{shape}/bs{bs}: output differs from vanilla away from a tie: {verdicts}"
    assert accepted > 0 and slots_whole(eng), "no draft accepted, or KV slots leaked"
    assert not eng.drafter.last, "finished requests must leave no drafter state"


def test_registry_entry(smollm2_fp32):
    d = make_drafter("medusa", smollm2_fp32)
    assert isinstance(d, MedusaDrafter) and d.capture_layers == (smollm2_fp32.cfg.num_layers - 1,)
    assert default_tree("medusa").depth <= d.heads.cfg.num_heads


@pytest.mark.parametrize("shape", [TreeShape.chain(3), TreeShape(2, 3, 6)], ids=["chain", "tree"])
def test_sampling_keeps_the_target_law(shape):
    """Unseeded sampling (speculative sampling, each request its own generator) of the 2nd and 3rd tokens;
    the heads are near their init (the target's own next-token prediction) with random blocks; their
    top-k proposals are point masses. This tiny target accepts some drafts and rejects others."""
    target = tiny_target(seed=0)
    heads = _random_heads(MedusaConfig.for_target(target.cfg, num_heads=3, draft_vocab_size=0), seed=2, scale=0.1)
    params = SamplingParams(temperature=0.7, max_new_tokens=3)
    eng = Engine(target, MedusaDrafter(target.model, heads), EngineConfig(tree=shape, kv_slots=SAMPLES * 16))
    reqs = [eng.add_request(PROMPT, params) for _ in range(SAMPLES)]
    for i, r in enumerate(reqs):
        r.generator.manual_seed(i)
    while eng.has_work:
        eng.step()
    v = target.cfg.vocab_size
    counts = torch.zeros(v, v, dtype=torch.float64)
    for r in reqs:
        counts[r.output_ids[1], r.output_ids[2]] += 1
    assert sum(r.stats.accepted_tokens for r in reqs) > SAMPLES * 0.2, "drafts must be accepted or this proves nothing"
    assert chi2_pvalue(counts, exact_joint_t2_t3(target.model, params)) > 1e-3
