"""The job's report: its header (machine, versions, commit), its headline numbers (values only: the docs
compare them with goals), results.json without NaN, and table.md."""

from __future__ import annotations

import math
import subprocess
from dataclasses import asdict
from pathlib import Path

import torch

from .config import REPO, GpuJobConfig


def headline(payload: dict) -> dict:
    """The numbers a reader looks for first, each None when its sections did not measure it."""
    pooled = {r["method"]: r for r in payload.get("bs1", {}).get("pooled", [])}
    rate = lambda m: (pooled.get(m) or {}).get("tokens_per_s")  # noqa: E731
    drafters = [r for r in pooled.values() if r["method"] not in ("vanilla", "hf-generate") and r["ratio_vs_vanilla"]]
    ours = [r["tokens_per_s"] for r in pooled.values() if r["method"] != "hf-generate" and r["tokens_per_s"]]
    best = max(drafters, key=lambda r: r["ratio_vs_vanilla"], default=None)
    sweep = payload.get("sweep", {})
    adaptive = {r["batch_size"]: r["speedup_vs_vanilla"] for r in sweep.get("rows", []) if r["adaptive"]}
    swept_all = bool(adaptive) and set(adaptive) == set(payload["config"]["batch_sizes"])
    return {
        "vanilla_bs1_tok_s": rate("vanilla"),
        "best_drafter_bs1": None if best is None else {"method": best["method"], "ratio": best["ratio_vs_vanilla"]},
        "adaptive_vs_vanilla": {
            "min": min(adaptive.values()) if swept_all and None not in adaptive.values() else None,
            "by_batch_size": adaptive,
        },
        "vs_hf_generate_bs1": max(ours) / rate("hf-generate") if ours and rate("hf-generate") else None,
        "greedy_identical": identity_summary(payload, drafters),
    }


def identity_summary(payload: dict, bs1_drafters: list[dict]) -> dict:
    """Identical prompts / prompts over every drafter run (identity section, bs-1 table, sweep), and the
    runs that failed or fell back to vanilla decoding (their tokens were then vanilla's, not the drafter's);
    a drafter skipped because it cannot load here is neither."""
    identity, sweep = payload.get("identity", {}).get("rows", []), payload.get("sweep", {}).get("identity", [])
    runs = [r for r in identity if r["method"] != "vanilla" and not r.get("error")] + sweep + bs1_drafters
    pooled = [r for r in payload.get("bs1", {}).get("pooled", []) if r["method"] not in ("vanilla", "hf-generate")]
    failed = [f"{r['method']} bs {r['batch_size']}: {_note(r)}" for r in identity if _note(r)]
    failed += [f"{r['method']} bs1: {_note(r)}" for r in pooled if _note(r) and not r["skipped"]]
    failed += [
        f"{r['method']}{' adaptive' if r['adaptive'] else ''} sweep bs {r['batch_size']}: "
        + (r["error"] or f"{r['fallbacks']} fallbacks to vanilla")
        for r in payload.get("sweep", {}).get("rows", [])
        if r["method"] != "vanilla" and (r["error"] or r["fallbacks"])
    ]
    prompts = sum(r["prompts"] for r in runs)
    return {
        "fraction": sum(r["identical"] for r in runs) / prompts if prompts else None,
        "prompts": prompts,
        "failed_runs": failed,
    }


def json_safe(x):
    """JSON without NaN / Infinity (not JSON): None instead."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def _commit(c: GpuJobConfig) -> str | None:
    if c.commit:
        return c.commit
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def header(c: GpuJobConfig, target, device: str) -> dict:
    import importlib.metadata
    import platform

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    gpu = device != "cpu"
    return {
        "job": "moa_serve.benchmarks.gpu_job",
        "smoke": c.smoke,
        "device": torch.cuda.get_device_name(device) if gpu else "cpu",
        "gpu_memory_gib": round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1) if gpu else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda if gpu else None,
        "transformers": version("transformers"),
        "python": platform.python_version(),
        "commit": _commit(c),
        "target": str(target.path),
        "dtype": str(target.model.dtype).removeprefix("torch."),
        "sampling": "greedy",
        "config": asdict(c),
    }


def _f(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _note(row: dict) -> str:
    """A row's error, or its drafter faults (requests sent back to vanilla decoding: no speculation)."""
    if row.get("error"):
        return row["error"]
    return f"{row['fallbacks']} fallbacks to vanilla: {row['fallback_reason']}" if row.get("fallbacks") else ""


def markdown(payload: dict) -> str:
    """The short report: the headline numbers, the pooled bs-1 table, the sweep grid, the step profile,
    large-batch throughput, identity and the GPU tests."""
    cfg = payload["config"]
    lines = [
        f"# GPU engine job{' (smoke)' if payload['smoke'] else ''}: {payload['device']}",
        "",
        f"torch {payload['torch']}, CUDA {payload['cuda']}, transformers {payload['transformers']}, commit "
        f"{payload['commit'] or 'unknown'}; target {Path(payload['target']).name} ({payload['dtype']}), greedy, "
        f"{cfg['max_new_tokens']} new tokens; {payload['seconds']:.0f} s of a {cfg['deadline_min']:g}-minute deadline.",
        "",
        "| number | value |",
        "|---|---|",
    ]
    h = payload["headline"]
    best, adaptive, ident = h["best_drafter_bs1"], h["adaptive_vs_vanilla"], h["greedy_identical"]
    lines += [
        f"| vanilla tok/s at bs 1 | {_f(h['vanilla_bs1_tok_s'], '.1f')} |",
        "| best drafter / vanilla at bs 1 | "
        + ("-" if best is None else f"{best['ratio']:.2f} ({best['method']})")
        + " |",
        "| adaptive / vanilla, lowest over the sweep | "
        + _f(adaptive["min"])
        + "".join(f"; bs {b}: {_f(v)}" for b, v in adaptive["by_batch_size"].items())
        + " |",
        f"| fastest method / transformers generate at bs 1 | {_f(h['vs_hf_generate_bs1'])} |",
        f"| greedy identical to vanilla (drafter runs) | {_f(ident['fraction'])} of {ident['prompts']} prompts |",
    ]
    lines += [f"- not identical: {r}" for r in ident["failed_runs"]]
    lines += [
        "",
        "| method | tree | tok/s (bs 1) | × vanilla | τ | draft tok/step | identical | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in payload.get("bs1", {}).get("pooled", []):
        lines.append(
            f"| {r['method']} | {r['tree']} | {_f(r['tokens_per_s'], '.1f')} | {_f(r['ratio_vs_vanilla'])} "
            f"| {_f(r['tau'])} | {_f(r['draft_per_step'], '.1f')} "
            f"| {r['identical']}/{r['prompts']} | {_note(r)} |"
        )
    sweep = payload.get("sweep", {})
    if sweep.get("table"):
        lines += ["", "Batch sweep, tok/s (× vanilla at the same batch size):", "", sweep["table"]]
    prof = [r for r in payload.get("profile", {}).get("rows", []) if not r.get("error")]
    if prof:
        lines += [
            "",
            "One request's steady-state step (profile.txt has the top ops):",
            "",
            "| method | tree | ms/step | tokens/step | kernel launches | graph launches | copies | syncs "
            "| device busy ms |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['method']} | {r['tree']} | {r['step_ms_median']:.2f} | {r['tokens_per_step']:.2f} "
            f"| {r['kernel_launches_per_step']:.0f} | {r['graph_launches_per_step']:.0f} | {r['copies_per_step']:.0f} "
            f"| {r['syncs_per_step']:.0f} | {r['device_busy_ms_per_step']:.2f} |"
            for r in prof
        ]
    thr = [r for r in payload.get("throughput", {}).get("rows", []) if not r.get("error")]
    if thr:
        lines += ["", "Vanilla decoding of a static batch (EOS ignored):", ""]
        lines += [
            "| batch size | overlapped loop | tok/s (all) | tok/s (decode phase) | ms per decode step |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['batch_size']} | {'on' if r.get('overlap') else 'off'} | {r['tokens_per_s']:.0f} "
            f"| {_f(r['decode_tokens_per_s'], '.0f')} | {_f(r['decode_step_ms'])} |"
            for r in thr
        ]
    failed = [r for k in ("profile", "throughput") for r in payload.get(k, {}).get("rows", []) if r.get("error")]
    lines += [f"- {r.get('method', r.get('batch_size'))}: {r['error']}" for r in failed]
    ident = payload.get("identity", {})
    if ident.get("rows"):
        cells = [
            f"{r['method']} bs {r['batch_size']}: {r.get('identical', '-')}/{r['prompts']}"
            + (f" ({_note(r)})" if _note(r) else "")
            for r in ident["rows"]
        ]
        lines += [
            "",
            "Greedy identity vs vanilla: "
            + "; ".join(cells)
            + f"; vanilla same at every batch size: {ident['vanilla_same_at_every_batch_size']}.",
        ]
    tests = payload.get("gpu_tests", {})
    lines += ["", f"`pytest -m gpu`: {tests.get('summary') or tests.get('skipped') or tests.get('error', '-')}"]
    for note in payload["deadline"]["stopped"]:
        lines.append(f"- deadline: {note}")
    errors = {k: v["error"] for k, v in payload.items() if isinstance(v, dict) and set(v) == {"error"}}
    lines += [f"- section {k} failed: {e}" for k, e in errors.items()]
    return "\n".join(lines) + "\n"
