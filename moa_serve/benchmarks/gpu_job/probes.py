"""The job's probes of why a step costs what it does: the steady-state step profile, vanilla throughput
at large batch sizes, and `pytest -m gpu` in a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from moa_serve.benchmarks.bench import bench_drafter

from .config import REPO, Deadline, GpuJobConfig, JobMethod, log, tests_reserve


def profile_section(c: GpuJobConfig, target, methods: list[JobMethod], prompts: list[list[int]], deadline) -> dict:
    """Vanilla's and one drafter's steady-state step (c.profile_methods, else the first drafter loaded)
    on the first prompt; profile.txt gets the rows as text."""
    from moa_serve.benchmarks.step_profile import profile_steps
    from sglang_ext.tree import TreeShape

    loaded = [m for m in methods if not m.skipped]
    chosen = [m for m in loaded if m.label in c.profile_methods] or loaded[:1]
    runs = [("vanilla", None, TreeShape.chain(1))] + [(m.label, m.source, m.tree) for m in chosen]
    rows, last = [], 0.0
    for label, source, tree in runs:
        if not deadline.allows(f"profile {label}", 2.0 * last + tests_reserve(c)):
            break
        t0 = time.perf_counter()
        try:
            drafter = bench_drafter(source, target) if source else None  # its own, as each engine's is
            rows.append({**profile_steps(target, drafter, tree, prompts[0]), "method": label})
        except Exception as e:  # noqa: BLE001 - reported in the row
            rows.append({"method": label, "tree": tree.label, "error": f"{type(e).__name__}: {e}"})
        log(f"profile {label}: {rows[-1].get('step_ms_median', rows[-1].get('error'))} ms per step")
        last = time.perf_counter() - t0
    (Path(c.out) / "profile.txt").write_text("".join(profile_text(r) for r in rows))
    return {"prompt_tokens": len(prompts[0]), "rows": rows}


def profile_text(row: dict) -> str:
    if row.get("error"):
        return f"## {row['method']}: {row['error']}\n\n"
    head = (
        f"## {row['method']} {row['tree']}: {row['step_ms_median']:.2f} ms per step (median; min "
        f"{row['step_ms_min']:.2f}), {row['tokens_per_step']:.2f} tokens per step, {row['tokens_per_s']:.0f} tok/s\n"
        f"per step: {row['kernel_launches_per_step']:.0f} kernel launches, {row['graph_launches_per_step']:.0f} "
        f"graph launches, {row['copies_per_step']:.0f} copies, {row['syncs_per_step']:.0f} syncs, device busy "
        f"{row['device_busy_ms_per_step']:.2f} ms\n"
    )
    parts = [head]
    for key in ("top_self_cpu", "top_self_device"):
        parts.append(f"{key} (per step): calls, self CPU ms, self device ms\n")
        parts += [
            f"  {o['op'][:90]:90s} {o['calls_per_step']:8.1f} {o['self_cpu_ms_per_step']:8.3f} "
            f"{o['self_device_ms_per_step']:8.3f}\n"
            for o in row[key]
        ]
    return "".join(parts) + "\n"


def throughput_section(c: GpuJobConfig, target, prompts: list[list[int]], deadline) -> dict:
    """Vanilla decoding of c.throughput_batch_sizes prompts at once (the mixed prompts, repeated); where the
    overlapped loop ran (a GPU), the same batch again without it (serving/decode_step.py)."""
    from moa_serve.benchmarks.step_profile import vanilla_throughput

    rows, last, last_bs = [], 0.0, 1
    for b in c.throughput_batch_sizes:
        need = last * b / last_bs + tests_reserve(c)
        if not deadline.allows(f"throughput batch size {b}", need):
            break
        t0 = time.perf_counter()
        batch = [prompts[i % len(prompts)] for i in range(b)]
        for overlap in (True, False):
            try:
                rows.append(vanilla_throughput(target, batch, c.max_new_tokens, overlap=overlap))
            except Exception as e:  # noqa: BLE001 - reported in the row
                rows.append({"batch_size": b, "overlap": overlap, "error": f"{type(e).__name__}: {e}"})
            log(f"throughput bs {b} overlap {overlap}: {rows[-1].get('tokens_per_s', rows[-1].get('error'))} tok/s")
            if not rows[-1].get("overlap") or not deadline.allows(f"throughput bs {b} without overlap", need):
                break
        last, last_bs = time.perf_counter() - t0, b
    return {"max_new_tokens": c.max_new_tokens, "ignore_eos": True, "rows": rows}


def gpu_tests_section(paths: tuple[str, ...], deadline: Deadline, out: Path, cache: str | None = None) -> dict:
    """`pytest -m gpu` over paths in a subprocess (collection errors, e.g. a test module needing
    fastapi, do not stop the others), bounded by what is left of the deadline; pytest.log has it all.
    cache: MOA_SERVE_CACHE for the tests (where the job converted the target's GGUF)."""
    if not paths:
        return {"skipped": "no test paths given"}
    timeout = deadline.left() - 5
    if timeout < 20:
        deadline.stopped.append(f"pytest -m gpu: left out, {deadline.left():.0f} s left")
        return {"skipped": "deadline"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors"]
    cmd += ["-m", "gpu", *paths]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    if cache:
        env["MOA_SERVE_CACHE"] = cache
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        rc, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = None, f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {timeout:.0f} s"
        text = text if isinstance(text, str) else text.decode(errors="replace")
    (out / "pytest.log").write_text(text)
    lines = [l.strip("= ") for l in text.splitlines() if l.strip()]
    summary = next(
        (l for l in reversed(lines) if re.search(r"\b(passed|failed|skipped|deselected|error|no tests ran)", l)), ""
    )
    counts = {
        k.rstrip("s"): int(n)
        for n, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)", summary)
    }
    return {
        "command": " ".join(cmd),
        "rc": rc,
        "summary": summary,
        "counts": counts,
        "seconds": time.perf_counter() - t0,
    }
