"""Self-distillation data (`moa-serve distill`) and fine-tuning a shipped drafter on it (`--init-from`)."""

from __future__ import annotations

import json

import pytest
import torch

from moa_serve.entrypoints.cli import main as cli_main
from moa_serve.entrypoints.distill import distill
from serving.config import EngineConfig
from serving.engine import Engine
from sglang_ext.sampling import SamplingParams
from sglang_ext.training.data import encode_conversation, open_conversations
from sglang_ext.training.dialogues import TurnQueue

QUESTIONS = [
    "Name three primary colors.",
    "What is 7 times 8?",
    "Write a haiku about rain.",
    "Define entropy in one sentence.",
]


def _conversations(path, n=None, follow_up=None):
    with open(path, "w") as f:
        for i, q in enumerate(QUESTIONS[:n]):
            turns = [
                {"role": "user", "content": q},
                {"role": "assistant", "content": "an answer not written by the target"},
            ]
            if follow_up:
                turns += [{"role": "user", "content": follow_up}, {"role": "assistant", "content": "nor this one"}]
            f.write(json.dumps({"id": f"q{i}", "conversations": turns}) + "\n")
    return path


def _alone(target, messages, params):
    """The target's own answer to one prompt, decoded alone."""
    r = Engine(target, None, EngineConfig(kv_slots=1024)).generate([target.encode_chat(messages)], params)[0]
    return target.tokenizer.decode(r.output_ids, skip_special_tokens=True).strip(), r


def test_distilled_answers_are_the_targets_own_greedy_answers(tmp_path, smollm2_fp32):
    target = smollm2_fp32
    src = _conversations(tmp_path / "convs.jsonl")
    records = []
    engine = Engine(target, None, EngineConfig(kv_slots=4096))
    n = distill(
        engine,
        lambda ids: target.tokenizer.decode(ids, skip_special_tokens=True).strip(),
        TurnQueue(open_conversations(str(src)), target.encode_chat, 512, conversations=3),
        SamplingParams(max_new_tokens=12),
        batch_size=2,
        write=records.append,
    )
    assert n == 3 and [r["id"] for r in sorted(records, key=lambda r: r["id"])] == ["q0", "q1", "q2"]
    assert not engine.running and not engine.waiting  # nothing left in flight
    for rec in records:
        user = rec["conversations"][0]
        alone = Engine(target, None, EngineConfig(kv_slots=1024)).generate(
            [target.encode_chat([user])], SamplingParams(max_new_tokens=12)
        )[0]
        assert rec["conversations"][1] == {
            "role": "assistant",
            "content": target.tokenizer.decode(alone.output_ids, skip_special_tokens=True).strip(),
        }
        assert rec["finish_reason"] == alone.finish_reason
    # the output is training data as is: our loader reads it and masks the new answers
    out = tmp_path / "distilled.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    convs = list(open_conversations(str(out)))
    ex = encode_conversation(target.tokenizer, convs[0].messages, 256)
    assert ex is not None and ex.loss_mask.any() and not ex.loss_mask.all()


def test_distill_cli_resumes_and_refuses_to_overwrite(tmp_path):
    src = _conversations(tmp_path / "convs.jsonl")
    out = tmp_path / "d.jsonl"
    base = [
        "distill",
        "--data",
        str(src),
        "--out",
        str(out),
        "--max-new-tokens",
        "4",
        "--batch-size",
        "2",
        "--threads",
        "1",
        "--no-progress",
    ]
    assert cli_main(base + ["--num-conversations", "2"]) == 0
    assert len(out.read_text().splitlines()) == 2
    with pytest.raises(SystemExit, match="--resume"):
        cli_main(base + ["--num-conversations", "3"])
    assert cli_main(base + ["--num-conversations", "3", "--resume"]) == 0
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert len(ids) == 3 and len(set(ids)) == 3


def _read(out):
    with open(out, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_later_turns_and_samples_are_the_targets_own(tmp_path, smollm2_fp32):
    """--turns 2: turn 2 is asked after the target's own turn-1 answer; --samples 2 at T 0.8: seeds s, s+1;
    --resume after a stop between the turns asks only turn 2, after the recorded answer."""
    target = smollm2_fp32
    src = _conversations(tmp_path / "convs.jsonl", n=2, follow_up="Now say it in French.")
    out = tmp_path / "d.jsonl"
    base = ["distill", "--data", str(src), "--out", str(out), "--max-new-tokens", "6", "--batch-size", "3"]
    base += ["--dtype", "float32", "--threads", "1", "--no-progress", "--num-conversations", "2"]  # as the fixture
    assert cli_main(base) == 0  # turn 1 only, greedy
    assert cli_main(base + ["--turns", "2", "--resume"]) == 0
    recs = {(r["id"], r["turn"]): r for r in _read(out)}
    assert sorted(recs) == [("q0", 1), ("q0", 2), ("q1", 1), ("q1", 2)]
    for cid in ("q0", "q1"):
        first, second = recs[(cid, 1)], recs[(cid, 2)]
        ctx = first["conversations"] + [{"role": "user", "content": "Now say it in French."}]
        assert second["conversations"][:-1] == ctx and second["prompt_ids"] == target.encode_chat(ctx)
        text, alone = _alone(target, ctx, SamplingParams(max_new_tokens=6))
        assert second["conversations"][-1]["content"] == text and second["output_ids"] == list(alone.output_ids)
    sampled = tmp_path / "s.jsonl"
    args = ["--out", str(sampled), "--samples", "2", "--temperature", "0.8", "--seed", "5", "--num-conversations", "1"]
    assert cli_main(base[:3] + args + base[5:-2]) == 0
    recs = _read(sampled)
    assert [(r["id"], r["sample"], r["turn"]) for r in recs] in (
        [("q0", 0, 1), ("q0", 1, 1)],
        [("q0", 1, 1), ("q0", 0, 1)],
    )
    for r in recs:
        _, alone = _alone(
            target, r["conversations"][:1], SamplingParams(max_new_tokens=6, temperature=0.8, seed=5 + r["sample"])
        )
        assert r["output_ids"] == list(alone.output_ids)
    with pytest.raises(SystemExit, match="--samples > 1 needs --temperature > 0"):
        cli_main(base[:3] + ["--out", str(tmp_path / "g.jsonl"), "--samples", "2"])


def test_distill_resumes_after_an_answer_holding_a_unicode_line_separator(tmp_path):
    """json.dumps(ensure_ascii=False) leaves U+2028/U+0085 raw; resuming must still read one record per line."""
    src = _conversations(tmp_path / "convs.jsonl")
    out = tmp_path / "d.jsonl"
    rec = {
        "id": "q0",
        "conversations": [
            {"role": "user", "content": QUESTIONS[0]},
            {"role": "assistant", "content": "red\u2028blue\x85green"},
        ],
        "finish_reason": "stop",
    }
    out.write_text(json.dumps(rec, ensure_ascii=False) + "\n", encoding="utf-8")
    assert (
        cli_main(
            [
                "distill",
                "--data",
                str(src),
                "--out",
                str(out),
                "--max-new-tokens",
                "4",
                "--batch-size",
                "2",
                "--threads",
                "1",
                "--no-progress",
                "--num-conversations",
                "2",
                "--resume",
            ]
        )
        == 0
    )
    with open(out, encoding="utf-8") as f:
        ids = [json.loads(line)["id"] for line in f]
    assert ids == ["q0", "q1"]


def test_fine_tune_a_shipped_drafter_with_init_from(tmp_path, smollm2_fp32, capsys):
    """--init-from keeps the checkpoint's draft vocab and starts from its weights (one step moves them a little)."""
    from sglang_ext.drafters.eagle3 import default_checkpoint
    from sglang_ext.models.eagle3 import load_eagle3

    src = _conversations(tmp_path / "convs.jsonl")
    ship = default_checkpoint(smollm2_fp32)
    out = tmp_path / "ft"
    args = [
        "train",
        "eagle3",
        "--data",
        str(src),
        "--out",
        str(out),
        "--init-from",
        str(ship),
        "--max-steps",
        "1",
        "--num-examples",
        "4",
        "--max-len",
        "64",
        "--tokens-per-batch",
        "256",
        "--threads",
        "1",
        "--no-progress",
        "--lr",
        "1e-5",
    ]
    assert cli_main(args) == 0
    before, after = load_eagle3(ship), load_eagle3(out / "heads" / "eagle3")
    assert torch.equal(before.d2t, after.d2t)
    delta = max(
        float((a - b).abs().max())
        for a, b in zip(after.state_dict().values(), before.state_dict().values())
        if a.is_floating_point()
    )
    assert 0 < delta < 0.05
    # a MoA checkpoint can't seed a run of another TLI
    args = ["train", "moa", "--tli", "1", "--data", str(src), "--out", str(tmp_path / "m"), "--max-steps", "1"]
    assert cli_main(args + ["--init-from", "drafters/smollm2-moa-tli0", "--threads", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("moa-serve train moa: error: --init-from") and "has TLI=0" in err and "asks for TLI=1" in err
