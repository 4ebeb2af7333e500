"""The GPU engine job (moa_serve/benchmarks/gpu_job/, python -m moa_serve.entrypoints.gpu_job) on CPU: its --smoke
run end to end, in a process where the packages a lent GPU machine lacks cannot be imported (fastapi, uvicorn,
xgrammar, sglang, gguf, ...; ../shared/notes/gpu.md) and our C++ kernels are off, as there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# not on the GPU machine (gguf travels as a wheel, installed only to convert the GGUF)
ABSENT = ("fastapi", "uvicorn", "starlette", "pydantic", "xgrammar", "sglang", "sgl_kernel", "flashinfer", "gguf")
ABSENT += ("openai", "llama_cpp")

BLOCKER = f"""
import sys

ABSENT = {ABSENT!r}


class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not on the GPU machine)", name=name)
        return None


sys.meta_path.insert(0, Absent())
"""


def _python(code: str, *args: str, timeout: int = 240, eval_dir=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "MOA_SERVE_CPU_KERNELS": "0"}
    if eval_dir is not None:
        env["MOA_SERVE_EVAL_DIR"] = str(eval_dir)
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + code, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_job_modules_import_without_what_the_gpu_machine_lacks():
    done = _python(
        "import moa_serve.benchmarks.gpu_job, moa_serve.entrypoints.gpu_job, serving.engine\n"
        "import moa_serve.benchmarks.batch, moa_serve.benchmarks.peers\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ABSENT))"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_smoke_job_end_to_end(tmp_path):
    """Random target of SmolLM2's family, 2 eval sets, 8 new tokens, bs 1 and 2: every section in the
    JSON, greedy identity holds, the shipped heads are skipped with the reason, the headline numbers filled in."""
    out = tmp_path / "job"
    evals = tmp_path / "eval"  # two sets of the EAGLE format here (../shared may be absent: both would be builtin)
    evals.mkdir()
    for name, turn in (("mt_bench", "Write a haiku about the sea."), ("gsm8k", "What is 12 times 7? Show the steps.")):
        (evals / f"{name}.jsonl").write_text(json.dumps({"turns": [turn]}) + "\n" + json.dumps({"turns": [turn * 2]}))
    args = ["--smoke", "--device", "cpu", "--out", str(out), "--eval-sets", "mt_bench,gsm8k"]
    args += ["--gpu-tests", "tests/test_layout.py"]  # the pytest step's code path: a file without GPU tests
    done = _python(
        "from moa_serve.entrypoints.gpu_job import main\nsys.exit(main(sys.argv[1:]))", *args, eval_dir=evals
    )
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert {"device", "torch", "commit", "profile", "identity", "bs1", "sweep", "throughput"} <= set(res)
    assert {"gpu_tests", "headline", "deadline"} <= set(res)
    assert res["smoke"] and res["device"] == "cpu" and "partial" not in res
    assert not [k for k, v in res.items() if isinstance(v, dict) and set(v) == {"error"}], "a section failed"

    status = {m["method"]: m["status"] for m in res["methods"]}
    assert status["ngram"] == status["suffix"] == status["lookahead"] == "loaded"
    assert status["suffix+eagle3"].startswith("skipped: cannot load on this target")  # (its eagle3 member)
    for head in ("eagle3", "moa", "medusa"):  # the shipped heads do not fit the smoke target: skipped, with the reason
        assert status[head].startswith("skipped: cannot load on this target") and "does not fit" in status[head]

    ident = res["identity"]
    assert ident["batch_sizes"] == [1, 2] and ident["vanilla_same_at_every_batch_size"] is True
    assert {(r["method"], r["batch_size"]) for r in ident["rows"]} == {
        (m, b) for m in ("vanilla", "ngram", "suffix", "lookahead") for b in (1, 2)
    }
    assert all(r["identical"] == r["prompts"] == 2 and not r["error"] for r in ident["rows"])

    pooled = {r["method"]: r for r in res["bs1"]["pooled"]}
    assert set(pooled) == {
        "vanilla",
        "ngram",
        "suffix",
        "lookahead",
        "eagle3",
        "moa",
        "medusa",
        "suffix+eagle3",
        "hf-generate",
    }
    for m in ("vanilla", "ngram", "suffix", "hf-generate"):
        assert pooled[m]["prompts"] == 2 and pooled[m]["tokens_per_s"] > 0, pooled[m]
    assert pooled["ngram"]["tau"] >= 1.0 and pooled["ngram"]["identical"] == 2
    assert pooled["eagle3"]["skipped"] and pooled["eagle3"]["tokens_per_s"] is None

    sweep = res["sweep"]
    assert sweep["batch_sizes"] == [1, 2] and sweep["best_drafter"]["method"] in ("ngram", "suffix", "lookahead")
    rows = {(r["method"], r["adaptive"], r["batch_size"]) for r in sweep["rows"] if not r["error"]}
    best = sweep["best_drafter"]["method"]
    assert rows == {(m, a, b) for m, a in (("vanilla", False), (best, False), (best, True)) for b in (1, 2)}
    assert all(r["identical"] == r["prompts"] for r in sweep["identity"]) and len(sweep["identity"]) == 4

    prof = {r["method"]: r for r in res["profile"]["rows"]}
    assert set(prof) == {"vanilla", "ngram"}  # the shipped EAGLE-3 does not load here: the first drafter loaded
    for r in prof.values():
        assert not r.get("error") and r["step_ms_median"] > 0 and r["profiled_steps"] == 3, r
        assert r["top_self_cpu"] and r["kernel_launches_per_step"] == 0 and not r["replayed_graph"]  # (a CPU)
    assert prof["vanilla"]["tokens_per_step"] == 1.0 and prof["ngram"]["tokens_per_step"] >= 1.0
    assert "## vanilla" in (out / "profile.txt").read_text()
    thr = res["throughput"]["rows"]
    assert [r["batch_size"] for r in thr] == [2, 4] and all(r["new_tokens"] == 8 * r["batch_size"] for r in thr)
    assert all(r["tokens_per_s"] > 0 for r in thr)
    assert not any(r["overlap"] for r in thr)  # (no graph runner on a CPU: nothing to overlap, one row per size)

    assert "deselected" in res["gpu_tests"]["summary"]
    h = res["headline"]
    assert set(h) == {
        "vanilla_bs1_tok_s",
        "best_drafter_bs1",
        "adaptive_vs_vanilla",
        "vs_hf_generate_bs1",
        "greedy_identical",
    }
    assert h["vanilla_bs1_tok_s"] == pooled["vanilla"]["tokens_per_s"] and h["vs_hf_generate_bs1"] > 0
    assert h["best_drafter_bs1"]["method"] in ("ngram", "suffix", "lookahead") and h["best_drafter_bs1"]["ratio"] > 0
    assert h["greedy_identical"]["fraction"] == 1.0 and h["greedy_identical"]["failed_runs"] == []
    assert set(h["adaptive_vs_vanilla"]["by_batch_size"]) == {"1", "2"} and h["adaptive_vs_vanilla"]["min"] > 0
    assert "threshold" not in json.dumps(res)  # (the job reports numbers; the docs hold the goals)
    table = (out / "table.md").read_text()
    assert "greedy identical to vanilla" in table and "hf-generate" in table


def test_engine_job_script_parses_and_prints_its_sequence():
    script = REPO / "scripts" / "gpu-engine-job.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert usage.returncode == 2 and "device 2:  bash scripts/gpu-engine-job.sh run" in usage.stdout


def test_train_job_script_parses_and_prints_its_sequence():
    script = REPO / "scripts" / "gpu-train-job.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert usage.returncode == 2 and "device N:  bash scripts/gpu-train-job.sh run" in usage.stdout
