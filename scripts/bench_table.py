"""Shared by the bs-1 feature benchmarks (structured-bench.py, prediction-bench.py): per-method totals
of finished requests, and the table + results.json they end with. The first method is the reference."""

from __future__ import annotations

import json
from pathlib import Path


def new_totals(methods, *counts: str) -> dict[str, dict]:
    return {m: {"tokens": 0, "seconds": 0.0, "steps": 0, "accepted": 0, **{c: 0 for c in counts}} for m in methods}


def record(t: dict, request, seconds: float) -> None:
    """Add one finished engine request's tokens, time and speculative stats to a method's totals."""
    t["seconds"] += seconds
    t["tokens"] += len(request.output_ids)
    t["steps"] += request.stats.verify_steps
    t["accepted"] += request.stats.accepted_tokens


def report(totals: dict[str, dict], counts: tuple[str, ...], args, out: str) -> None:
    """Print tok/s, the ratio to the first method and tau (+ the `counts` columns); write out/results.json."""
    first = next(iter(totals.values()))
    base = first["tokens"] / first["seconds"]
    print(f"{'method':20} {'tok/s':>7} {'ratio':>6} {'tau':>5}" + "".join(f" {c:>16}" for c in counts))
    for name, t in totals.items():
        tps = t["tokens"] / t["seconds"]
        tau = (t["accepted"] + t["steps"]) / t["steps"] if t["steps"] else 0.0
        t.update(tokens_per_s=tps, ratio=tps / base, tau=tau)
        print(f"{name:20} {tps:7.1f} {tps / base:6.2f} {tau:5.2f}" + "".join(f" {t[c]:16d}" for c in counts))
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "results.json").write_text(json.dumps({"args": vars(args), "methods": totals}, indent=1))
