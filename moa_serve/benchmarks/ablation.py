"""The table of a recipe-variant job (`moa-serve train job --heads moa-tli1,moa-tli1@lambda_feat=0.3,...`):
every head was trained on the same batches, so their held-out scores compare at equal tokens.

    python -m moa_serve.benchmarks.ablation runs/ablation [--baseline moa-tli1] [--depth 6]

Per head: held-out top-1 agreement with the target at draft depth 0..6 (MoA: rows 1..7 tokens after
their verification point; EAGLE-3: training-time-test steps), the chain acceptance it implies,
tau_chain(D) = 1 + sum_{d=1..D} prod_{j<d} acc_j (each depth's agreement taken as independent of the
others; an estimate for ranking recipes, not a measured tau), and both as differences to the baseline.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEPTHS = 7


class AblationError(ValueError):
    pass


def chain_tau(acc: list[float], depth: int) -> float:
    """1 + expected accepted tokens of a chain of `depth` drafts whose step d is right with probability acc[d]."""
    tau, alive = 1.0, 1.0
    for a in acc[:depth]:
        alive *= a
        tau += alive
    return tau


def rows(run_dir: Path, baseline: str | None = None, depth: int = 6) -> list[dict]:
    path = run_dir / "summary.json"
    if not path.is_file():
        raise AblationError(f"{path} does not exist (a finished `moa-serve train job` run writes it)")
    summary = json.loads(path.read_text())
    held = summary.get("held_out") or {}
    if not held:
        raise AblationError(f"{path} has no held-out scores (train with --holdout > 0)")
    base = baseline or summary["heads"][0]
    if base not in held:
        raise AblationError(f"baseline {base!r} is not one of the run's heads: {', '.join(held)}")
    out = []
    for head, m in held.items():
        acc = [m.get(f"acc_{d}", float("nan")) for d in range(DEPTHS)]
        out.append({"head": head, "acc": acc, "tau_chain": chain_tau(acc, depth)})
    ref = next(r for r in out if r["head"] == base)
    for r in out:
        r["d_acc0"] = r["acc"][0] - ref["acc"][0]
        r["d_tau"] = r["tau_chain"] - ref["tau_chain"]
    return out


def markdown(table: list[dict], depth: int = 6) -> str:
    head = "| head | " + " | ".join(f"acc d{d}" for d in range(DEPTHS)) + f" | τ chain {depth} | Δ acc d0 | Δ τ chain |"
    lines = [head, "|" + "---|" * (DEPTHS + 4)]
    for r in table:
        accs = " | ".join(f"{a:.3f}" for a in r["acc"])
        lines.append(f"| {r['head']} | {accs} | {r['tau_chain']:.3f} | {r['d_acc0']:+.3f} | {r['d_tau']:+.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moa_serve.benchmarks.ablation", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--baseline", default=None, help="the head others are compared to (default: the run's first)")
    p.add_argument("--depth", type=int, default=6, help="chain length of the tau estimate")
    args = p.parse_args(argv)
    try:
        table = rows(args.run_dir, args.baseline, args.depth)
    except (AblationError, json.JSONDecodeError, KeyError) as e:
        print(f"moa_serve.benchmarks.ablation: error: {e}", file=sys.stderr)
        return 2
    print(markdown(table, args.depth))
    return 0


if __name__ == "__main__":
    sys.exit(main())
