"""Shared trainer + data pipeline: formats, loss masks, clear errors, TTT training lowers the loss,
checkpoints resume."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from helpers import tiny_config, tiny_state

from sglang_ext.models import LlamaModel
from sglang_ext.models.eagle3 import Eagle3Config, Eagle3Draft, load_eagle3
from sglang_ext.training.data import (
    DataError,
    Example,
    encode_conversation,
    iter_json_array,
    make_batches,
    open_conversations,
    token_counts,
)
from sglang_ext.training.eagle3 import Eagle3Task
from sglang_ext.training.target import TargetRunner
from sglang_ext.training.trainer import OptimConfig, RunConfig, Trainer, counted_seconds, lr_factor


def _sharegpt(i, turns=(("human", "hi"), ("gpt", "hello there"))):
    return {"id": f"c{i}", "conversations": [{"from": f, "value": v} for f, v in turns]}


# --- reading ----------------------------------------------------------------------------------
def test_truncated_json_array_keeps_complete_records(tmp_path):
    text = json.dumps([_sharegpt(i) for i in range(5)], indent=2)
    cut = text[: text.index('"c4"') + 20]  # cut inside the last record
    p = tmp_path / "sg.json"
    p.write_text(cut)
    assert [r["id"] for r in iter_json_array(p, chunk_chars=7)] == ["c0", "c1", "c2", "c3"]
    assert [c.id for c in open_conversations(str(p))] == ["c0", "c1", "c2", "c3"]


def test_specforge_jsonl_and_role_normalisation(tmp_path):
    p = tmp_path / "d.jsonl"
    recs = [
        {
            "id": "a",
            "conversations": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
            ],
        },
        {
            "id": "b",
            "conversations": [
                {"role": "assistant", "content": "orphan"},
                {"role": "user", "content": "q2"},
                {"role": "assistant", "content": "a2"},
            ],
        },
        {"id": "c", "conversations": [{"role": "user", "content": "no answer"}]},
    ]
    p.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    convs = list(open_conversations(str(p)))
    assert [c.id for c in convs] == ["a", "b"]
    assert [m["role"] for m in convs[0].messages] == ["system", "user", "assistant"]
    assert [m["role"] for m in convs[1].messages] == ["user", "assistant"]  # leading assistant turn dropped


@pytest.mark.parametrize(
    "content,match",
    [
        ("", "is empty"),
        (
            '{"id": 1, "conversations": [{"role": "user", "content": "only a question"}]}\n',
            "no conversation with an assistant turn",
        ),
        ('{"id": 1, "messages": []}\n', "expected an object with a 'conversations' list"),
        ('{"id": 1, "conversations": [{"speaker": "x", "text": "y"}]}\n', "role/content"),
        ("not json\n", "not valid JSON"),
    ],
)
def test_bad_data_clear_errors(tmp_path, content, match):
    p = tmp_path / "bad.jsonl"
    p.write_text(content)
    with pytest.raises(DataError, match=match):
        list(open_conversations(str(p)))


def test_missing_file_and_eval_dir_refused(tmp_path):
    from sglang_ext.evalsets import eval_dir

    with pytest.raises(DataError, match="does not exist"):
        list(open_conversations(str(tmp_path / "nope.jsonl")))
    ev = eval_dir()
    if ev is not None:
        with pytest.raises(DataError, match="evaluation set"):
            list(open_conversations(str(next(ev.glob("*.jsonl")))))


def test_eval_prompts_are_excluded(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(json.dumps([_sharegpt(0, (("human", "secret eval prompt"), ("gpt", "x"))), _sharegpt(1)]))
    assert [c.id for c in open_conversations(str(p), {"secret eval prompt"})] == ["c1"]


def test_sharegpt_package_parses():
    from sglang_ext.training.data import sharegpt_path

    it = iter_json_array(sharegpt_path())
    first = next(it)
    assert first["conversations"][0]["from"] in ("human", "gpt", "system")


# --- chat template and loss mask --------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from sglang_ext.models.loader import load_tokenizer, resolve_target

    return load_tokenizer(resolve_target("smollm2"))


def test_loss_mask_covers_exactly_the_assistant_spans(tokenizer):
    msgs = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "It is 4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "Six."},
    ]
    ex = encode_conversation(tokenizer, msgs, 4096)
    assert ex.input_ids.tolist() == tokenizer.encode(
        tokenizer.apply_chat_template(msgs, tokenize=False), add_special_tokens=False
    )
    spans, cur = [], []
    for t, m in zip(ex.input_ids.tolist(), ex.loss_mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            spans.append(tokenizer.decode(cur))
            cur = []
    if cur:
        spans.append(tokenizer.decode(cur))
    assert [s.strip() for s in spans] == ["It is 4.<|im_end|>", "Six.<|im_end|>"]
    assert encode_conversation(tokenizer, msgs, 8) is None  # truncated before any assistant token


def test_batches_respect_token_budget():
    exs = [Example(torch.arange(n), torch.ones(n, dtype=torch.bool)) for n in (3, 5, 8, 2, 9, 4)]
    batches = make_batches(exs, 10, seed=0)
    assert sorted(int(l) for b in batches for l in b.lengths) == [2, 3, 4, 5, 8, 9]
    for b in batches:
        assert b.input_ids.numel() <= 10 or b.input_ids.shape[0] == 1
        for i, l in enumerate(b.lengths):
            assert not b.loss_mask[i, l:].any()
    assert token_counts(exs, 10)[1] == 6


def test_lr_schedule_warmup_then_cosine():
    assert lr_factor(0.0, 0.1, 0.0) < 0.01 and lr_factor(0.05, 0.1, 0.0) == pytest.approx(0.5)
    assert lr_factor(0.1, 0.1, 0.0) == pytest.approx(1.0)
    assert lr_factor(0.55, 0.1, 0.0) == pytest.approx(0.5)
    assert lr_factor(1.0, 0.1, 0.05) == pytest.approx(0.05)


# --- training ---------------------------------------------------------------------------------
def _tiny_setup(tmp_path, steps, seed=0):
    cfg = tiny_config(vocab=64, layers=6)
    target = LlamaModel(cfg, tiny_state(cfg, seed))
    torch.manual_seed(seed)
    draft = Eagle3Draft(Eagle3Config.for_target(cfg, 48))
    g = torch.Generator().manual_seed(seed)
    exs = []
    for _ in range(8):  # repetitive sequences: learnable in a few steps
        base = torch.randint(0, 48, (6,), generator=g)
        ids = base.repeat(5)
        exs.append(Example(ids, torch.arange(ids.numel()) >= 4))
    draft.set_vocab(torch.topk(token_counts(exs, 64).float() + torch.arange(64).flip(0) * 1e-3, 48).indices)
    task = Eagle3Task(target, draft, ttt_length=3)
    batches = make_batches(exs, 64, seed=0)
    trainer = Trainer(
        task,
        TargetRunner(target, 64),
        batches,
        OptimConfig(lr=3e-3, warmup_ratio=0.1),
        RunConfig(str(tmp_path), steps, save_every_s=1e9, progress_bar=False),
    )
    return task, trainer, batches


def test_suspended_step_counts_at_the_recent_rate():
    recent: list[tuple[float, int]] = []
    for _ in range(5):
        assert counted_seconds(2.0, recent, 1000) == 2.0  # 2 ms per token
    assert counted_seconds(3.0, recent, 1000) == 3.0  # a slow step still counts as it took
    assert counted_seconds(900.0, recent, 500) == pytest.approx(1.0)  # SIGSTOPped for 15 min: 500 tokens at 2 ms
    assert len(recent) == 7


def test_short_ttt_run_lowers_loss(tmp_path):
    task, trainer, batches = _tiny_setup(tmp_path, steps=40)

    def eval_loss():
        with torch.no_grad():
            return sum(task.loss(b, trainer.runner.run(b, task.capture_layers), 0.0)[0].item() for b in batches) / len(
                batches
            )

    before = eval_loss()
    final = trainer.fit()
    after = eval_loss()
    assert after < 0.8 * before, (before, after)
    assert {"loss_0", "acc_0", "loss_2", "acc_2", "grad_norm", "lr"} <= set(final)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 40 and (tmp_path / "tb").is_dir()
    ckpt = tmp_path / "checkpoints" / (tmp_path / "latest").read_text().strip()
    loaded = load_eagle3(ckpt, task.target.cfg)
    assert json.loads((ckpt / "config.json").read_text())["training"]["step"] == 40
    assert torch.equal(loaded.d2t, task.draft.d2t)


def test_resume_continues_exactly(tmp_path):
    # 6 steps straight vs 3 steps + save + resume + 3 steps: same weights
    task_a, trainer_a, _ = _tiny_setup(tmp_path / "a", steps=6)
    trainer_a.fit()
    task_b, trainer_b, _ = _tiny_setup(tmp_path / "b", steps=6)
    trainer_b.run_cfg = RunConfig(str(tmp_path / "b"), 6, save_every_s=1e9, progress_bar=False)
    for _ in range(3):
        trainer_b.train_step(trainer_b.batch_at(trainer_b.step))
        trainer_b.step += 1
    trainer_b.save()
    task_c, trainer_c, _ = _tiny_setup(tmp_path / "b", steps=6, seed=0)
    assert trainer_c.resume() and trainer_c.step == 3
    trainer_c.fit()
    for (k, a), c in zip(task_a.draft.state_dict().items(), task_c.draft.state_dict().values()):
        assert torch.allclose(a, c, atol=1e-6), k


def test_train_cli_parser_and_errors(tmp_path, capsys):
    from moa_serve.entrypoints.train import add_train_parser, train_config

    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", "eagle3", "--data", str(tmp_path / "x.jsonl"), "--out", str(tmp_path / "o")])
    cfg = train_config(args)
    assert cfg.heads == ("eagle3",) and cfg.eagle3.ttt_length == 7 and cfg.draft_vocab_size == 16384
    assert cfg.device == "auto" and cfg.num_examples == 2000 and cfg.resume is None and cfg.threads == 2
    moa = train_config(parser.parse_args(["train", "moa", "--tli", "1", "--data", "d", "--out", "o", "--resume"]))
    assert moa.heads == ("moa-tli1",) and moa.resume == "" and moa.moa.lambda_kl == 1.0
    job = train_config(parser.parse_args(["train", "job", "--shards", "s", "--out", "o", "--resume", "runs/a"]))
    assert job.heads == ("eagle3", "moa-tli0", "moa-tli1") and job.data == ("s",) and job.resume == "runs/a"
    assert job.tokens_per_batch == 32768 and job.holdout == 0.005 and not job.progress
    (tmp_path / "x.jsonl").write_text("")
    assert args.train_fn(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moa-serve train eagle3: error: training data") and err.endswith("is empty")
    assert "\n" not in err
