"""The benchmark harness itself: tau arithmetic, same-run speedups, failed methods reported."""

import json

from serving.bench import MethodResult, markdown_table
from serving.cli import main


def test_tau_from_known_accepts():
    r = MethodResult("x", "s", "-", verify_steps=3, accepted=2 + 0 + 3, drafted=15, tokens=8, seconds=2.0)
    assert r.tau == (3 + 1 + 4) / 3 and r.draft_per_step == 5 and r.tokens_per_s == 4


def test_speedup_uses_same_run_vanilla_and_failures_are_rows():
    rows = [
        MethodResult("vanilla", "a", "-", tokens=10, seconds=1.0, verify_steps=10, prompts=1),
        MethodResult("ngram", "a", "4,1,5", tokens=10, seconds=0.5, verify_steps=5, accepted=5, prompts=1, identical=1),
        MethodResult("vanilla", "b", "-", tokens=10, seconds=2.0, verify_steps=10, prompts=1),
        MethodResult("ngram", "b", "4,1,5", tokens=10, seconds=0.5, verify_steps=5, accepted=5, prompts=1),
        MethodResult("eagle3", "b", "6,4,24", error="FileNotFoundError: no checkpoint"),
    ]
    table = markdown_table(rows)
    assert "| a | ngram | 4,1,5 | 2.00 | 0.0 | 20.0 | 2.00× | 1/1 |" in table
    assert "4.00×" in table  # set b's own vanilla (5 tok/s), not set a's
    assert "failed: FileNotFoundError" in table


def test_bench_quick_end_to_end(tmp_path):
    out = tmp_path / "bench"
    rc = main(["bench", "--quick", "--eval-sets", "builtin", "--peers", "none", "--methods", "ngram;nope", "--dtype", "float32", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    by = {r["method"]: r for r in data["results"]}
    assert by["vanilla"]["tokens"] > 0 and by["ngram"]["verify_steps"] > 0 and by["ngram"]["identical"] == 2
    assert "unknown drafter" in by["nope"]["error"]
    assert "| builtin | ngram |" in (out / "table.md").read_text()
