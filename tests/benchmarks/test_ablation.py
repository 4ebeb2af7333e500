"""The recipe-variant table: a real --smoke job with variant heads, read back."""

from __future__ import annotations

import pytest

from moa_serve.benchmarks.ablation import chain_tau, main, rows
from moa_serve.entrypoints.train import main as train_main


def test_chain_tau():
    assert chain_tau([1.0] * 7, 6) == 7.0 and chain_tau([0.0] * 7, 6) == 1.0
    assert chain_tau([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert chain_tau([0.5, 0.5, 0.5], 1) == 1.5


def test_the_table_of_a_variant_job(tmp_path, capsys):
    out = tmp_path / "run"
    heads = "moa-tli1,moa-tli1@position_decay=0.7,moa-tli1@lambda_feat=0.5@lr=3e-4"
    argv = ["train", "job", "--smoke", "--device", "cpu", "--threads", "1", "--heads", heads, "--out", str(out)]
    assert train_main(argv) == 0
    table = rows(out, depth=6)
    assert [r["head"] for r in table] == heads.split(",")
    assert table[0]["d_acc0"] == 0.0 and table[0]["d_tau"] == 0.0
    for r in table:
        assert len(r["acc"]) == 7 and 1.0 <= r["tau_chain"] <= 7.0
    capsys.readouterr()
    assert main([str(out), "--baseline", "moa-tli1@position_decay=0.7"]) == 0
    md = capsys.readouterr().out.splitlines()
    assert md[0].startswith("| head | acc d0") and len(md) == 2 + 3 and "| moa-tli1@position_decay=0.7 |" in md[3]
    assert main([str(out), "--baseline", "eagle3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moa_serve.benchmarks.ablation: error: baseline 'eagle3' is not one of") and "\n" not in err
    assert main([str(tmp_path / "none")]) == 2
