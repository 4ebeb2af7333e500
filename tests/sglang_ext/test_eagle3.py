"""EAGLE-3: checkpoint format (ours, SpecForge's, SGLang's name handling), train/infer consistency,
greedy identity through the engine."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from helpers import (
    compare_to_reference,
    drafter_pools_whole,
    extend_whole_and_pair_by_pair,
    off_stretches_run,
    tiny_config,
    tiny_state,
    together_and_alone,
)
from safetensors.torch import load_file, save_file

from serving.config import EngineConfig
from serving.engine import Engine
from sglang_ext.drafters.eagle3 import Eagle3Drafter
from sglang_ext.models import LlamaModel, Target
from sglang_ext.models.checkpoint import CheckpointError
from sglang_ext.models.eagle3 import Eagle3Config, Eagle3Draft, load_eagle3, vocab_from_counts
from sglang_ext.sampling import SamplingParams
from sglang_ext.training.data import Batch
from sglang_ext.training.eagle3 import Eagle3Task
from sglang_ext.training.target import TargetRunner
from sglang_ext.tree import TreeShape

VOCAB, DRAFT_VOCAB, LAYERS = 64, 48, 6


def tiny_pair(seed=0) -> tuple[Target, Eagle3Draft]:
    cfg = tiny_config(vocab=VOCAB, layers=LAYERS)
    target = Target(model=LlamaModel(cfg, tiny_state(cfg, seed)), tokenizer=None, path=None)
    torch.manual_seed(seed)
    draft = Eagle3Draft(Eagle3Config.for_target(cfg, DRAFT_VOCAB))
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # norms away from 1, so the test sees every weight
    counts = torch.arange(VOCAB).flip(0).float()  # low ids most frequent; drop the 16 rarest
    draft.set_vocab(vocab_from_counts(counts, DRAFT_VOCAB))
    return target, draft


def test_vocab_maps_are_consistent():
    counts = torch.tensor([5, 0, 9, 1, 7, 3])
    hot = vocab_from_counts(counts, 3)
    assert hot.tolist() == [0, 2, 4]
    d = Eagle3Draft(Eagle3Config.for_target(tiny_config(vocab=6, layers=4), 3))
    d.set_vocab(hot)
    assert d.d2t.tolist() == [0, 1, 2]  # target id = i + d2t[i]
    assert d.t2d.tolist() == [True, False, True, False, True, False]
    assert d.hot_ids.tolist() == [0, 2, 4]


def test_save_load_round_trip_is_exact(tmp_path):
    target, draft = tiny_pair()
    x = torch.randn(5, 3 * 32)
    emb = torch.randn(5, 32)
    pos = torch.arange(5)

    def logits(m):
        feat = m.fuse(x)
        q, k, v = m.qkv(emb, feat, pos)
        attn = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.repeat_interleave(2, 1).transpose(0, 1),
            v.repeat_interleave(2, 1).transpose(0, 1),
            is_causal=True,
        )
        return m.logits(m.finish(attn.transpose(0, 1), feat))

    draft.save(tmp_path / "fp32", dtype=torch.float32)
    assert torch.equal(logits(load_eagle3(tmp_path / "fp32", target.cfg)), logits(draft))
    draft.save(tmp_path / "bf16")  # the shipped format
    as_bf16 = Eagle3Draft(draft.cfg)
    as_bf16.load_state_dict(
        {k: (v.bfloat16().float() if v.is_floating_point() else v) for k, v in draft.state_dict().items()}
    )
    assert torch.equal(logits(load_eagle3(tmp_path / "bf16", target.cfg)), logits(as_bf16))
    assert (
        load_eagle3(tmp_path / "bf16", target.cfg, dtype=torch.bfloat16).inv_freq.dtype == torch.float32
    )  # RoPE stays exact
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == DRAFT_VOCAB
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(draft.cfg.aux_layers)
    names = set(load_file(tmp_path / "bf16" / "model.safetensors"))
    assert not any("embed" in n for n in names)
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight"} <= names


def _specforge_checkpoint(
    path: Path, draft: Eagle3Draft, layers_prefix: str, with_embed: bool, aux_in_config: bool
) -> None:
    """A checkpoint as SpecForge 0.2.0 writes it (HF LlamaConfig dump + draft state dict in bf16)."""
    c = draft.cfg
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": c.intermediate_size,
        "max_position_embeddings": 2048,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "num_hidden_layers": 1,
        "pad_token_id": 0,
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.53.2",
        "use_cache": True,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "rope_theta": c.rope_theta,
    }
    if aux_in_config:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(c.aux_layers), "use_aux_hidden_state": True}
    state = {
        k.replace("midlayer.", layers_prefix): v.bfloat16() if v.is_floating_point() else v
        for k, v in draft.state_dict().items()
    }
    if with_embed:
        state["embed_tokens.weight"] = torch.zeros(c.vocab_size, c.hidden_size, dtype=torch.bfloat16)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(state, path / "model.safetensors")


@pytest.mark.parametrize("prefix,embed,aux", [("midlayer.", True, False), ("layers.0.", False, True)])
def test_specforge_checkpoint_loads(tmp_path, prefix, embed, aux):
    target, draft = tiny_pair()
    _specforge_checkpoint(tmp_path / "sf", draft, prefix, embed, aux)
    got = load_eagle3(tmp_path / "sf", target.cfg)
    assert got.cfg.aux_layers == draft.cfg.aux_layers  # without eagle_config: SGLang's default layers
    for k, v in draft.state_dict().items():
        assert torch.equal(got.state_dict()[k], v.bfloat16().to(v.dtype) if v.is_floating_point() else v), k


def test_bad_checkpoints_give_clear_errors(tmp_path):
    target, draft = tiny_pair()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_eagle3(tmp_path, target.cfg)
    draft.save(tmp_path / "ok")
    other = tiny_config(vocab=VOCAB + 1, layers=LAYERS)
    with pytest.raises(CheckpointError, match="vocab"):
        load_eagle3(tmp_path / "ok", other)
    (tmp_path / "ok" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_eagle3(tmp_path / "ok", target.cfg)


# --- SGLang 0.5.23 name handling --------------------------------------------------------------
def _sglang_load_weights():
    """LlamaForCausalLMEagle3.load_weights, taken verbatim from the installed SGLang source.

    NOTE: importing sglang.srt.models.llama_eagle3 on this CPU-only machine fails (it pulls in
    torchvision and CUDA-only layers), so the class cannot be constructed. We run its real
    load_weights code path (parsed out of the installed file) against the parameter names the
    class's modules register (model.fc, model.layers.0.{self_attn.qkv_proj, self_attn.o_proj,
    mlp.gate_up_proj, mlp.down_proj, *norm}, model.norm, lm_head, model.embed_tokens).
    """
    import sglang

    src = (Path(sglang.__file__).parent / "srt" / "models" / "llama_eagle3.py").read_text()
    cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "LlamaForCausalLMEagle3")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "load_weights")
    ns = {"torch": torch, "Iterable": object, "Tuple": object, "default_weight_loader": None}
    exec(compile(ast.Module([fn], []), "llama_eagle3.py", "exec"), ns)
    return ns["load_weights"]


def test_checkpoint_names_accepted_by_sglang_load_weights(tmp_path):
    _, draft = tiny_pair()
    draft.save(tmp_path / "d")
    c = draft.cfg
    loaded: dict[str, list] = {}

    class Param:
        def __init__(self, name, shape):
            self.name, self.shape = name, shape

        def weight_loader(self, param, w, shard=None):
            assert param is self
            loaded.setdefault(self.name, []).append((shard, tuple(w.shape)))

    qkv_out = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    params = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.fc.weight": (c.hidden_size, 3 * c.hidden_size),
        "model.layers.0.self_attn.qkv_proj.weight": (qkv_out, 2 * c.hidden_size),
        "model.layers.0.self_attn.o_proj.weight": (c.hidden_size, c.num_heads * c.head_dim),
        "model.layers.0.mlp.gate_up_proj.weight": (2 * c.intermediate_size, c.hidden_size),
        "model.layers.0.mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        "model.layers.0.input_layernorm.weight": (c.hidden_size,),
        "model.layers.0.post_attention_layernorm.weight": (c.hidden_size,),
        "model.layers.0.hidden_norm.weight": (c.hidden_size,),
        "model.norm.weight": (c.hidden_size,),
        "lm_head.weight": (c.draft_vocab_size, c.hidden_size),
    }

    class FakeEagle3:
        hot_token_id = None

        def named_parameters(self):
            return [(n, Param(n, s)) for n, s in params.items()]

    model = FakeEagle3()
    _sglang_load_weights()(model, load_file(tmp_path / "d" / "model.safetensors").items())
    assert set(loaded) == set(params) - {"model.embed_tokens.weight"}  # embeddings come from the target
    assert sorted(s for s, _ in loaded["model.layers.0.self_attn.qkv_proj.weight"]) == ["k", "q", "v"]
    assert sorted(s for s, _ in loaded["model.layers.0.mlp.gate_up_proj.weight"]) == [0, 1]
    shapes = {s: shp for s, shp in loaded["model.layers.0.self_attn.qkv_proj.weight"]}
    assert shapes["q"][0] + shapes["k"][0] + shapes["v"][0] == qkv_out and shapes["q"][1] == 2 * c.hidden_size
    for name, shape in params.items():
        if name in loaded and "qkv" not in name and "gate_up" not in name:
            assert loaded[name] == [(None, shape)], name
    assert torch.equal(model.hot_token_id, draft.hot_ids)


# --- training-time test == inference ----------------------------------------------------------
def test_ttt_unroll_matches_inference_chain():
    """Step j of the TTT unroll at row t gives the same logits as the drafter's depth-j chain node."""
    target, draft = tiny_pair(seed=1)
    drafter = Eagle3Drafter(target.model, draft)
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    engine = Engine(target, drafter, EngineConfig(tree=TreeShape.chain(4)))
    recorded = []  # draft-vocab logits of the root, then of each chain step
    logits = drafter.draft.logits
    drafter.draft.logits = lambda out: recorded.append(logits(out)) or recorded[-1]
    req = engine.add_request(prompt, SamplingParams(max_new_tokens=2))
    engine.step()  # prefill + first token (the root)
    engine.step()  # one draft (root + 3 chain steps) and verify
    root = req.output_ids[0]
    chain = [int(draft.hot_ids[r.argmax(-1).flatten()[0]]) for r in recorded[:4]]
    seq = torch.tensor(prompt + [root] + chain)
    batch = Batch(seq[None], torch.ones(1, len(seq), dtype=torch.bool), torch.tensor([len(seq)]))
    task = Eagle3Task(target.model, draft, ttt_length=4, autocast=False)
    tout = TargetRunner(target.model, 64).run(batch, task.capture_layers)
    feats = torch.cat([tout.captured[l] for l in task.capture_layers], -1)
    # re-run the unroll, keeping each step's output at row t = last prompt position
    t = len(prompt) - 1
    steps = _unroll_logits(task, batch, feats)
    for j in range(4):
        assert torch.allclose(steps[j][0, t], recorded[j].flatten(0, -2)[0], atol=1e-4), f"step {j}"


def _unroll_logits(task: Eagle3Task, batch: Batch, feats: torch.Tensor) -> list[torch.Tensor]:
    from sglang_ext.training.eagle3 import _heads, shift, ttt_attention

    d, ids = task.draft, batch.input_ids
    b, t = ids.shape
    rep = d.cfg.num_heads // d.cfg.num_kv_heads
    feat, keys, values, out = d.fuse(feats), [], [], []
    with torch.no_grad():
        for j in range(task.ttt_length):
            q, k, v = d.qkv(task.target.embed[shift(ids, 1 + j)], feat, (torch.arange(t) + j).expand(b, t))
            keys.append(_heads(k, rep) if j == 0 else k)
            values.append(_heads(v, rep) if j == 0 else v)
            feat = d.finish(ttt_attention(q, keys, values, task.scale), feat)
            out.append(d.logits(feat))
    return out


# --- greedy identity through the engine --------------------------------------------------------
@pytest.mark.parametrize(
    "shape",
    [TreeShape.chain(4), TreeShape(4, 3, 10), TreeShape(4, 3, 10, min_prob=0.02)],
    ids=["chain4", "tree4x3x10", "tree4x3x10-min-prob"],
)
@pytest.mark.parametrize("bs", [1, 4])
def test_greedy_identity_tiny(shape, bs):
    target, draft = tiny_pair(seed=2)
    g = torch.Generator().manual_seed(bs)
    prompts = [
        torch.randint(0, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(3, 20, (4,), generator=g)
    ]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ref = [r.output_ids for r in Engine(target, None).generate(prompts, params)]
    drafter = Eagle3Drafter(target.model, draft)
    eng = Engine(target, drafter, EngineConfig(tree=shape))
    outs = []
    for i in range(0, len(prompts), bs):
        outs += [r.output_ids for r in eng.generate(prompts[i : i + bs], params)]
    verdicts = [compare_to_reference(target.model, p, r, o) for p, r, o in zip(prompts, ref, outs)]
    assert "bug" not in verdicts, verdicts
    assert drafter_pools_whole(drafter) and not drafter.reqs, "draft KV or request state leaked"


@pytest.mark.slow
@pytest.mark.parametrize("bs", [1, 4])
def test_greedy_identity_smollm2(smollm2_fp32, eval_prompts, bs):
    """SmolLM2 fp32, shipped drafter if present (else a random draft with the target's head), bs 1 and 4."""
    from sglang_ext.drafters.eagle3 import default_checkpoint

    try:
        draft = load_eagle3(default_checkpoint(smollm2_fp32), smollm2_fp32.cfg)
    except CheckpointError:
        draft = Eagle3Draft(Eagle3Config.for_target(smollm2_fp32.cfg, 16384))
        draft.set_vocab(torch.arange(16384))
        with torch.no_grad():
            draft.lm_head.weight.copy_(smollm2_fp32.model.lm_head[:16384])
    prompts = eval_prompts[:8]
    params = SamplingParams(max_new_tokens=32)
    ref = [r.output_ids for r in Engine(smollm2_fp32, None).generate(prompts, params)]
    eng = Engine(smollm2_fp32, Eagle3Drafter(smollm2_fp32.model, draft), EngineConfig(tree=TreeShape(5, 4, 16)))
    reqs = []
    for i in range(0, len(prompts), bs):
        reqs += eng.generate(prompts[i : i + bs], params)
    verdicts = [compare_to_reference(smollm2_fp32.model, p, r, q.output_ids) for p, r, q in zip(prompts, ref, reqs)]
    print(
        f"eagle3 bs{bs}: {verdicts.count('same')} same, {verdicts.count('tie')} ties; tau "
        f"{sum(q.stats.accept_length for q in reqs) / len(reqs):.2f}"
    )
    assert "bug" not in verdicts, verdicts


@pytest.mark.parametrize("shape", [TreeShape.chain(3), TreeShape(3, 2, 6)], ids=["sampled-chain", "tree"])
def test_sampling_runs_and_drafts_stay_in_vocab(shape):
    """Sampled chains carry q over the target vocab; tree drafts map draft ids back to target ids."""
    target, draft = tiny_pair(seed=4)
    drafter = Eagle3Drafter(target.model, draft)
    eng = Engine(target, drafter, EngineConfig(tree=shape))
    falls = []
    eng.on_fallback = lambda r, reason: falls.append(reason)
    reqs = eng.generate(
        [[1, 2, 3, 4], [5, 6, 7]], SamplingParams(max_new_tokens=16, temperature=1.0, seed=0, ignore_eos=True)
    )
    assert not falls and all(len(r.output_ids) == 16 for r in reqs)
    assert all(r.stats.draft_tokens > 0 for r in reqs)


def test_draft_norm_uses_the_kernel_when_drafting_and_torch_when_training():
    """Drafting (fp32, no autograd) runs the draft layers' RMSNorm as one kernel call: the same
    formula as the torch ops (only the mean's summation order differs); training keeps the torch
    ops, which autograd needs."""
    from sglang_ext import kernels
    from sglang_ext.models.llama import RMSNorm, _uses_norm_kernel

    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 64)
    ref = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)) * norm.weight.detach()
    with torch.inference_mode():
        assert _uses_norm_kernel(x, norm.weight) == (kernels.rms_norm is not None)
        fast = norm(x)
    assert fast.shape == x.shape
    torch.testing.assert_close(fast, ref, rtol=1e-6, atol=1e-6)
    xg = x.clone().requires_grad_()
    assert not _uses_norm_kernel(xg, norm.weight)
    y = norm(xg)
    y.sum().backward()
    assert torch.equal(y.detach(), ref) and xg.grad is not None and norm.weight.grad is not None


def test_a_batch_extend_leaves_each_request_the_state_it_gets_alone():
    """The batch's pending pairs go through one fuse, one allocation, one flat causal mask and one
    layer pass; each request's draft K/V and root output equal what it gets extended alone."""
    from sglang_ext.drafters.base import TargetCapture

    target, draft = tiny_pair(seed=1)
    together, alone = Eagle3Drafter(target.model, draft), Eagle3Drafter(target.model, draft)
    g = torch.Generator().manual_seed(0)
    h = target.model.cfg.hidden_size

    def capture(ids, start):
        n = len(ids)
        hidden = {l: torch.randn(n, h, generator=g) for l in together.capture_layers}
        return TargetCapture(ids, torch.arange(start, start + n), torch.arange(start, start + n), hidden)

    def check(batch):
        out = together._extend(batch)
        for i, d in enumerate(batch):
            torch.testing.assert_close(out[i], alone._extend([d])[0], rtol=0, atol=1e-6)
            a, b = together.reqs[d.rid].slots, alone.reqs[d.rid].slots
            torch.testing.assert_close(together.kv.k[0][a], alone.kv.k[0][b], rtol=0, atol=1e-6)
            torch.testing.assert_close(together.kv.v[0][a], alone.kv.v[0][b], rtol=0, atol=1e-6)

    tokens = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 3)]
    together_and_alone(together, alone, tokens, capture, check)


def test_an_extend_runs_the_layer_for_each_requests_last_pair_only():
    """Only a request's last pending pair's output is read (its search's root): the pairs before it get their K/V
    alone (a prompt's first extend). Its root output and every pair's K/V equal what extending pair by pair gives
    (each pair through the whole layer); prompts of 1 (the whole layer only), 6 and 11 pairs in one batch; and a
    step's few pairs (2, 1, 3: fewer than kv_only_rows before the last ones), all through the whole layer."""
    target, draft = tiny_pair(seed=3)
    for lengths in ([6, 1, 11], [2, 1, 3]):
        whole, stepwise = Eagle3Drafter(target.model, draft), Eagle3Drafter(target.model, draft)
        extend_whole_and_pair_by_pair(whole, stepwise, lengths, VOCAB)


class _PerRequestCommits(Eagle3Drafter):
    """EAGLE-3 committed request by request on every step (what the engine did before commit_roots)."""

    commits_roots = False


def test_a_step_without_drafting_commits_every_root_in_one_call():
    """`commits_roots`: on a step whose trees are all roots (speculation off) the engine hands the drafter every
    request's captured rows in one commit_roots call, not a capture and a commit per request. Two requests, off in
    stretches: no commit() on an off step, one commit_roots; the same trees and tokens as committed request by
    request; the output is vanilla's."""
    target, draft = tiny_pair(seed=5)
    prompts = [[3, 9, 4, 1, 7, 2, 8], [5, 1, 6, 6, 2]]
    params, off = SamplingParams(max_new_tokens=40, ignore_eos=True), {*range(3, 7), *range(12, 30)}
    runs, calls = {}, []
    for cls in (Eagle3Drafter, _PerRequestCommits):
        drafter = cls(target.model, draft)
        roots = drafter.commit_roots
        drafter.commit_roots = lambda rids, captured, roots=roots: calls.append(rids) or roots(rids, captured)
        runs[cls] = off_stretches_run(target, drafter, prompts, params, off, TreeShape(2, 2, 4))
    (steps, drafted, out), (ref_steps, ref_drafted, ref_out) = runs[Eagle3Drafter], runs[_PerRequestCommits]
    assert all(k == 0 for call, k in steps if call in off) and all(k == 2 for call, k in ref_steps if call in off)
    assert len(calls) == sum(call in off for call, _ in steps) and all(len(rids) == 2 for rids in calls)
    assert drafted == ref_drafted and len(drafted) > 10 and out == ref_out
    assert out == [r.output_ids for r in Engine(target, None).generate(prompts, params)]
