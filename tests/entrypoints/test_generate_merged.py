"""`moa-serve generate --drafter suffix+eagle3 --json` (a merged multi-drafter tree) prints the same
greedy tokens as `--drafter none` on eval prompts, with per-member statistics."""

import json

import pytest

import serving.engine as engine_mod
from moa_serve.entrypoints.cli import main
from sglang_ext.evalsets import load_eval_set


@pytest.mark.parametrize("eval_set", ["gsm8k", "humaneval"])
def test_generate_with_a_merged_drafter_is_greedy_identical(smollm2_fp32, monkeypatch, capsys, eval_set):
    monkeypatch.setattr(engine_mod, "load_target", lambda *a, **k: smollm2_fp32)  # the session's copy
    prompt = load_eval_set(eval_set, 1)[1][0][:600]
    out = {}
    for drafter in ["none", "suffix+eagle3"]:
        flags = ["generate", "--chat", "--prompt", prompt, "--max-new-tokens", "24", "--json", "--drafter", drafter]
        assert main(flags) == 0
        out[drafter] = json.loads(capsys.readouterr().out)
    merged = out["suffix+eagle3"]
    assert merged["token_ids"] == out["none"]["token_ids"]
    assert merged["drafter"] == "suffix+eagle3" and merged["tree"] == [3, 2, 6] and merged["tree_min_prob"] == 0.1
    assert set(merged["members"]) == {"suffix", "eagle3"} and merged["accept_length"] > 1.0
    assert sum(m["accepted"] for m in merged["members"].values()) > 0


def test_a_bad_merged_drafter_is_a_clear_error(smollm2_fp32, monkeypatch, capsys):
    monkeypatch.setattr(engine_mod, "load_target", lambda *a, **k: smollm2_fp32)
    assert main(["generate", "--prompt", "hi", "--drafter", "suffix+nope"]) == 2
    assert "'nope' is not a drafter" in capsys.readouterr().err
