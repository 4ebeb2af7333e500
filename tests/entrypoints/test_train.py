"""`moa-serve train` end to end: the GPU job's --smoke run under real torchrun with two gloo ranks from a fresh
copy of the repository (held-out scores equal the one-process run's), and a run stopped at a checkpoint then
resumed with --resume ends bit-identical to an uninterrupted one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from moa_serve.entrypoints.cli import main as cli_main
from sglang_ext.models.checkpoint import read_weights

REPO = Path(__file__).resolve().parents[2]
SMOKE = ["train", "job", "--smoke", "--device", "cpu"]


def _fresh_clone(dest: Path) -> Path:
    """The files a clone of this working tree has (tracked and new, nothing ignored: no build outputs)."""
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        src = REPO / name.decode()
        if src.is_file():
            (dest / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name.decode())
    return dest


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(cwd), OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def test_torchrun_two_ranks_run_the_smoke_job_as_one_process(tmp_path):
    clone = _fresh_clone(tmp_path / "clone")
    torchrun = str(Path(sys.executable).parent / "torchrun")
    two = _run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "moa_serve.entrypoints.cli", *SMOKE], clone)
    assert two.returncode == 0, two.stderr[-3000:]
    one = _run([sys.executable, "-m", "moa_serve.entrypoints.cli", *SMOKE, "--out", str(tmp_path / "one")], clone)
    assert one.returncode == 0, one.stderr[-3000:]
    s2 = json.loads((clone / "runs" / "smoke" / "summary.json").read_text())  # --smoke's default --out
    s1 = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert (s1["world_size"], s2["world_size"]) == (1, 2)
    assert s1["steps"] == s2["steps"] == 3 and s1["tokens_seen"] == s2["tokens_seen"] > 0
    assert s1["held_out"].keys() == s2["held_out"].keys() == {"eagle3", "moa-tli0", "moa-tli1"}
    for head, scores in s1["held_out"].items():
        assert scores.keys() == s2["held_out"][head].keys() and "loss" in scores
        for k, v in scores.items():
            assert abs(v - s2["held_out"][head][k]) <= 1e-5 * max(abs(v), 1e-6), (head, k, v, s2["held_out"][head][k])
    assert two.stderr.count('"world_size": 2') == 1  # only rank 0 logs the summary


def _heads(out: Path) -> dict[str, torch.Tensor]:
    return {f"{h.name}.{k}": v for h in sorted((out / "heads").iterdir()) for k, v in read_weights(h).items()}


def test_a_stopped_run_resumed_ends_bit_identical(tmp_path):
    """The smoke job (EAGLE-3 and MoA TLI=0/1) straight for 3 steps vs stopped at step 1 and resumed: the same
    fp32 trainer state and servable heads, bit for bit; checkpoints every step on the way."""
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert cli_main([*SMOKE, "--out", str(straight), "--threads", "1"]) == 0
    assert cli_main([*SMOKE, "--out", str(stopped), "--threads", "1", "--stop-at-step", "1"]) == 0
    assert (stopped / "latest").read_text().strip() == "step_1"
    assert cli_main([*SMOKE, "--out", str(stopped), "--threads", "1", "--resume", "--save-every-steps", "1"]) == 0
    assert (stopped / "latest").read_text().strip() == "step_3"
    assert sorted(p.name for p in (stopped / "checkpoints").iterdir()) == ["step_3"]  # (the job keeps 1)
    a = torch.load(straight / "checkpoints" / "step_3" / "trainer_state.pt", weights_only=False)
    b = torch.load(stopped / "checkpoints" / "step_3" / "trainer_state.pt", weights_only=False)
    assert a["step"] == b["step"] == 3 and a["tokens_seen"] == b["tokens_seen"]
    for ma, mb in zip(a["module"], b["module"]):
        assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    ha, hb = _heads(straight), _heads(stopped)
    assert ha.keys() == hb.keys() and all(torch.equal(ha[k], hb[k]) for k in ha)
    steps = [json.loads(line)["step"] for line in (stopped / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_a_fresh_run_refuses_another_runs_directory(tmp_path, capsys):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "latest").write_text("step_5\n")
    assert cli_main(["train", "job", "--shards", str(tmp_path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(
        f"error: {out} holds a run (latest: step_5): pass --resume to continue it, or choose another --out"
    )
    resume = ["--out", str(tmp_path / "b"), "--resume", str(out)]
    assert cli_main(["train", "job", "--shards", str(tmp_path), *resume]) == 2
    assert "names step_5, which has no trainer_state.pt" in capsys.readouterr().err
