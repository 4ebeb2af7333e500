"""Recipe variants in one job (`<head>@key=value...`): each head its own options and learning rate, on the
same batches and target run; MoA's draft-position weighting and extra SA layers (a training ablation
that the drafters refuse to serve)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config, tiny_state

from moa_serve.entrypoints.train import main as train_main
from sglang_ext.drafters.base import DrafterError
from sglang_ext.drafters.moa import MoADrafter
from sglang_ext.models import LlamaModel
from sglang_ext.models.llama import rms_norm
from sglang_ext.models.moa import MoAConfig, MoADraft, load_moa
from sglang_ext.training import job as job_mod
from sglang_ext.training import moa as moa_mod
from sglang_ext.training.config import MoAOptions, TrainConfig, TrainError, head_options
from sglang_ext.training.data import Example, make_batches
from sglang_ext.training.target import TargetRunner
from sglang_ext.training.trainer import OptimConfig, RunConfig, Trainer


def _examples(vocab: int, lengths=(30, 26, 34, 21), seed=0) -> list[Example]:
    g = torch.Generator().manual_seed(seed)
    return [Example(torch.randint(0, vocab, (n,), generator=g), torch.arange(n) >= 3) for n in lengths]


def _target(vocab=64, layers=4):
    cfg = tiny_config(vocab=vocab, layers=layers)
    return LlamaModel(cfg, tiny_state(cfg, 0))


def test_a_variant_overrides_its_heads_options_and_learning_rate():
    cfg = TrainConfig(out="o", heads=("moa-tli1",), lr=1e-4, moa=MoAOptions(lambda_feat=0.1))
    opts, lr = head_options("moa-tli1@lambda_feat=0.3@sa_layers=2@lr=3e-4@no_lsa=true@position_decay=0.8", cfg)
    assert (opts.lambda_feat, opts.sa_layers, opts.no_lsa, opts.position_decay, lr) == (0.3, 2, True, 0.8, 3e-4)
    assert opts.lambda_kl == cfg.moa.lambda_kl and opts.min_gap == cfg.moa.min_gap  # the rest: the run's
    assert head_options("moa-tli1", cfg) == (cfg.moa, None)  # None: the run's
    e3, _ = head_options("eagle3@decay=0.7@ttt_length=5", cfg)
    assert (e3.decay, e3.ttt_length) == (0.7, 5)
    bad = {
        "moa-tli1@lambda_feat": "a variant is @key=value",
        "moa-tli1@bogus=1": "moa has no option 'bogus'",
        "eagle3@lambda_feat=0.3": "eagle3 has no option 'lambda_feat'",
        "moa-tli1@sa_layers=two": "sa_layers='two' is not a int",
        "moa-tli1@sa_layers=0": "sa_layers >= 1",
        "moa-tli1@position_decay=1.5": "position_decay <= 1",
        "moa-tli1@min_gap=9@max_gap=4": "min_gap <= max_gap",
        "moa-tli1@lr=-1": "lr must be > 0",
        "moa-tlix@lr=1": "unknown head 'moa-tlix'",
    }
    for head, msg in bad.items():
        with pytest.raises(TrainError, match=msg):
            TrainConfig(out="o", heads=(head,)).checked()


def test_variants_train_on_the_same_batches_each_with_its_own_recipe(tmp_path):
    target = _target()
    batches = make_batches(_examples(64), 256, 0)
    heads = ("moa-tli1", "moa-tli1@lr=4e-3", "moa-tli1@sa_layers=2", "moa-tli1@position_decay=0.5")
    tasks = job_mod.build_tasks(target, torch.arange(64), heads, {"min_gap": 3, "max_gap": 5})
    assert [t.name for t in tasks] == list(heads) and [t.lr for t in tasks] == [None, 4e-3, None, None]
    assert tasks[3].position_decay == 0.5 and tasks[2].draft.cfg.sa_layers == 2
    assert len(tasks[2].draft.more_self_attention) == 1 and not hasattr(tasks[0].draft, "more_self_attention")
    start = {k: v.clone() for k, v in tasks[0].draft.state_dict().items()}
    for t in tasks[1:]:  # the same seed: every variant of the same shape starts from the same weights
        for k, v in t.draft.state_dict().items():
            if k in start:
                assert torch.equal(v, start[k]), (t.name, k)
    trainer = Trainer(
        tasks,
        TargetRunner(target, 256),
        batches,
        OptimConfig(lr=1e-4),
        RunConfig(str(tmp_path), 10, progress_bar=False),
    )
    m = trainer.train_step(trainer.batches[0])
    lrs = [opt.param_groups[0]["lr"] for opt in trainer.opts]
    assert lrs[1] == pytest.approx(40 * lrs[0]) and lrs[2] == lrs[3] == lrs[0] == pytest.approx(m["lr"])
    # the same verification points for every variant (one seed): the uniform heads' first losses are equal
    assert float(m["moa-tli1/loss"]) == pytest.approx(float(m["moa-tli1@lr=4e-3/loss"]), rel=1e-6)
    extra = tasks[2].draft.more_self_attention[0].self_attn.q_proj.weight
    assert extra.grad is not None and extra.grad.abs().sum() > 0
    moved = [
        (t.draft.self_attention.self_attn.q_proj.weight - start["self_attention.self_attn.q_proj.weight"]).abs().max()
        for t in tasks[:2]
    ]
    assert moved[1] > 10 * moved[0] > 0  # Adam's first step is about lr per weight


def test_position_decay_weighs_rows_by_their_draft_depth():
    target = _target()
    batch = make_batches(_examples(64), 256, 0)[0]
    runner = TargetRunner(target, 256)
    draft = MoADraft(MoAConfig.for_target(target.cfg, tli=0))
    task = moa_mod.MoATask(target, draft, 1.0, 0.0, 3, 5, position_decay=0.5)
    b, t = batch.input_ids.shape
    v = moa_mod.last_points(b, t, 3, 5, torch.Generator().manual_seed(1))
    stair = torch.ones(b, dtype=torch.bool)
    tout = runner.run(batch, (len(target.layers) - 1,))
    with torch.no_grad():
        hidden, feat = task.forward(batch, tout, v, stair)
        kl = {}
        for decay in (0.5, 1.0):
            task.position_decay = decay
            kl[decay] = float(task._loss(batch, tout, v, hidden, feat)[1]["kl"])
        # reference: KL(p || q) per counted row, weighted decay**depth (depth = row - v(row) - 1)
        p = torch.softmax(tout.logits(target.lm_head).float(), -1)
        logq = torch.log_softmax(
            torch.nn.functional.linear(rms_norm(hidden, target.norm, target.cfg.rms_norm_eps), target.lm_head).float(),
            -1,
        )
        rows = (p * (p.clamp_min(1e-20).log() - logq)).sum(-1)
        w = batch.counted()
        depth = (torch.arange(t)[None, :] - v - 1).clamp(min=0).float()
        for decay in (0.5, 1.0):
            weights = torch.where(w, decay**depth, 0.0)
            assert kl[decay] == pytest.approx(float((weights * rows).sum() / weights.sum()), rel=1e-5)
    assert kl[0.5] != pytest.approx(kl[1.0], rel=1e-3)


def test_extra_sa_layers_round_trip_and_are_refused_for_serving(tmp_path):
    target = _target()
    draft = MoADraft(MoAConfig.for_target(target.cfg, tli=1, sa_layers=3))
    draft.save(tmp_path / "ckpt", dtype=torch.float32)
    loaded = load_moa(tmp_path / "ckpt", target.cfg)
    assert loaded.cfg.sa_layers == 3 and len(loaded.more_self_attention) == 2
    for (k, a), b in zip(draft.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), k
    with pytest.raises(DrafterError, match="runs 1 SA layer; the checkpoint has 3"):
        MoADrafter(target, loaded)
    with pytest.raises(
        TrainError, match="3 SA layer.s.; this run asks for TLI=1, memory lsa, 1 SA layer"
    ):  # fine-tuning keeps the head's shape
        job_mod._load_head("moa", 1, tmp_path / "ckpt", target, MoAOptions())


def test_a_variant_starts_from_its_base_heads_checkpoint(tmp_path):
    for head in ("moa-tli1", "eagle3"):
        (tmp_path / head).mkdir()
        (tmp_path / head / "config.json").write_text("{}")
    assert job_mod._init_dir(tmp_path, "moa-tli1@lambda_feat=0.3", 2) == tmp_path / "moa-tli1"
    (tmp_path / "moa-tli1@lr=1e-3").mkdir()
    (tmp_path / "moa-tli1@lr=1e-3" / "config.json").write_text("{}")
    assert job_mod._init_dir(tmp_path, "moa-tli1@lr=1e-3", 2) == tmp_path / "moa-tli1@lr=1e-3"
    with pytest.raises(TrainError, match="no moa-tli0@sa_layers=2/ checkpoint"):
        job_mod._init_dir(tmp_path, "moa-tli0@sa_layers=2", 2)


def test_the_cli_refuses_a_bad_variant_in_one_line(capsys):
    code = train_main(["train", "job", "--smoke", "--device", "cpu", "--heads", "eagle3,moa-tli1@lambda_fet=0.3"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert err.startswith("moa-serve train job: error: head 'moa-tli1@lambda_fet=0.3': moa has no option")


def test_a_grown_head_starts_exactly_where_its_checkpoint_was(tmp_path):
    """--init-from a one-SA-layer head with @sa_layers=2: the added layer starts as an identity."""
    target = _target()
    torch.manual_seed(0)
    MoADraft(MoAConfig.for_target(target.cfg, tli=1)).save(tmp_path / "moa-tli1", dtype=torch.float32)
    one = load_moa(tmp_path / "moa-tli1", target.cfg)
    two = job_mod._load_head("moa", 1, tmp_path / "moa-tli1", target, MoAOptions(sa_layers=2))
    assert two.cfg.sa_layers == 2 and len(two.more_self_attention) == 1
    batch = make_batches(_examples(64), 256, 0)[0]
    tout = TargetRunner(target, 256).run(batch, (2, 3))
    b, t = batch.input_ids.shape
    v = moa_mod.last_points(b, t, 3, 5, torch.Generator().manual_seed(0))
    stair = torch.tensor([True, False, True, False][:b])
    outs = [moa_mod.MoATask(target, d, min_gap=3, max_gap=5).forward(batch, tout, v, stair) for d in (one, two)]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    loss = moa_mod.MoATask(target, two, min_gap=3, max_gap=5).loss(batch, tout, 0.5)[0]
    loss.backward()
    assert two.more_self_attention[0].self_attn.o_proj.weight.grad.abs().sum() > 0  # and it can learn


def test_init_from_shipped_maps_each_head_to_the_targets_shipped_drafter():
    from sglang_ext.drafters.shipped import SHIPPED_DIR

    path = "/models/SmolLM2-135M-Instruct"
    got = job_mod.shipped_init(("eagle3", "moa-tli1@sa_layers=2", "moa-tli0"), path)
    assert got == {
        "eagle3": SHIPPED_DIR / "smollm2-eagle3",
        "moa-tli1@sa_layers=2": SHIPPED_DIR / "smollm2-moa-tli1",
        "moa-tli0": SHIPPED_DIR / "smollm2-moa-tli0",
    }
    # the GPU job's target: the GGUF converted into <cache>/<file stem>
    assert job_mod.shipped_init(("eagle3",), "/tmp/cache/SmolLM2-135M-Instruct.Q4_1") == {"eagle3": got["eagle3"]}
    with pytest.raises(TrainError, match="no shipped 'moa-tli3' drafter"):
        job_mod.shipped_init(("moa-tli3",), path)
    with pytest.raises(TrainError, match="needs a real target"):
        job_mod.shipped_init(("eagle3",), None)
