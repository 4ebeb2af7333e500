"""`moa-serve generate --drafter medusa --json` (the shipped heads) prints vanilla's greedy tokens."""

from __future__ import annotations

import json

from helpers import compare_to_reference

from moa_serve.entrypoints.cli import main as cli_main
from sglang_ext.drafters import default_tree
from sglang_ext.evalsets import load_eval_set


def _generate(capsys, prompt: str, drafter: str) -> dict:
    argv = ["generate", "--chat", "--prompt", prompt, "--drafter", drafter, "--max-new-tokens", "24", "--json"]
    assert cli_main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_json_with_medusa_is_greedy_identical_to_none(capsys, smollm2_fp32):
    accepted = 0
    for name in ("mt_bench", "gsm8k"):
        text = load_eval_set(name, 1)[1][0][:600]
        vanilla, medusa = _generate(capsys, text, "none"), _generate(capsys, text, "medusa")
        prompt = smollm2_fp32.encode_chat([{"role": "user", "content": text}])
        verdict = compare_to_reference(smollm2_fp32.model, prompt, vanilla["token_ids"], medusa["token_ids"])
        assert verdict != "bug", f"{name}: medusa's tokens differ from vanilla's away from a tie"
        assert medusa["drafter"] == "medusa" and medusa["tree"][:3] == [
            default_tree("medusa").depth,
            default_tree("medusa").topk,
            default_tree("medusa").num_draft_tokens,
        ]
        accepted += medusa["verify_steps"] < len(medusa["token_ids"])
    assert accepted > 0, "no draft was accepted: the comparison proves nothing"
