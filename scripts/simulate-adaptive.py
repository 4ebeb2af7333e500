"""Adaptive speculation on a simulated CPU: the policy in serving/adaptive.py (or another commit's)
against always-off, batch sizes 1..64, many seeds. No model runs: each step's cost and tokens come
from a model of this project's CPU machine, so policies can be compared on the same random draws.

    .venv/bin/python scripts/simulate-adaptive.py [--seeds 24] [--steps 300]
    .venv/bin/python scripts/simulate-adaptive.py --baseline 381e9a9   # the policy at another commit

The machine: verify cost per step by rows, measured on a 2-core AMD EPYC (forward + lm_head, fp32, 2
threads; flat to 4 rows, ~2.3 ms per row past 8); drafting 0.3 ms per request (the suffix drafter).
The content: each request accepts each draft node with a probability around a level that jumps
every ~50 steps (0.25-0.7, as text turns formulaic or free), and drafts its full chain 80 % of the
time (the suffix drafter has nothing to say otherwise). The machine's speed alternates every 100
steps between 1 and 1/1.3, and 1 % of steps are 3x slower (neighbours), for both sides alike.
Menu: the serving default for the suffix drafter, off / chain 3,1,4 / chain 1,1,2.
Prints, per batch size, the mean and worst ratio of the policy's tokens/s to always-off's.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sglang_ext.tree import TreeShape  # noqa: E402

# (rows, ms) of a verify forward on the CPU machine (the adaptive policy's cost-model points, then linear)
ROW_MS = [
    (1, 14.2),
    (2, 16.3),
    (3, 18.0),
    (4, 19.2),
    (5, 25.0),
    (6, 32.4),
    (8, 36.4),
    (10, 39.9),
    (13, 46.3),
    (15.5, 51.9),
    (19, 62.3),
    (22, 68.7),
    (28, 81.5),
    (64, 160),
    (128, 300),
    (256, 590),
]
DRAFT_S = 0.0003  # per request


def verify_seconds(rows: float) -> float:
    for (r0, s0), (r1, s1) in zip(ROW_MS, ROW_MS[1:]):
        if rows <= r1:
            return (s0 + (s1 - s0) * (rows - r0) / (r1 - r0)) / 1000
    return ROW_MS[-1][1] / 1000 * rows / ROW_MS[-1][0]


def load_policy(baseline: str | None):
    if baseline is None:
        from serving.adaptive import AdaptiveSpeculation

        return AdaptiveSpeculation
    src = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{baseline}:serving/adaptive.py"], check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "adaptive_baseline.py"
    path.write_text(src.replace("from .metrics import", "from serving.metrics import"))
    spec = importlib.util.spec_from_file_location("adaptive_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod.AdaptiveSpeculation


def run(policy_cls, seed: int, batch_sizes, steps: int) -> dict[int, float]:
    rng = random.Random(seed)
    policy = policy_cls(TreeShape(3, 1, 4))
    depth = [0 if o is None else o.depth for o in policy.options]
    level, ratios = 0.45, {}
    for bs in batch_sizes:
        spec_s = off_s = 0.0
        tokens = 0
        for step in range(steps):
            if rng.random() < 0.02:
                level = rng.choice([0.25, 0.35, 0.45, 0.55, 0.7])
            o = policy.choose(bs)
            d = depth[o]
            accepted, drafted = [], []
            for _ in range(bs):
                q = min(0.95, max(0.05, level + rng.gauss(0, 0.15)))
                n = d if rng.random() < 0.8 else rng.randint(0, d)
                a = 0
                while a < n and rng.random() < q:
                    a += 1
                accepted.append(a)
                drafted.append(n)
            speed = 1.0 if (step // 100) % 2 == 0 else 1.3
            noise = math.exp(rng.gauss(0, 0.08)) * (3 if rng.random() < 0.01 else 1) * speed
            rows = bs + sum(drafted)
            draft = DRAFT_S * bs * noise if d else 0.0
            seconds = verify_seconds(rows) * noise + draft
            step_tokens = bs + sum(accepted)
            try:
                policy.observe(
                    o, bs, seconds, step_tokens, rows, draft_seconds=draft, accepted=accepted, drafted=drafted
                )
            except TypeError:  # an older policy without the proposal's time and per-request counts
                policy.observe(o, bs, seconds, step_tokens, rows)
            spec_s += seconds
            tokens += step_tokens
            off_s += verify_seconds(bs) * math.exp(rng.gauss(0, 0.08)) * (3 if rng.random() < 0.01 else 1) * speed
        ratios[bs] = (tokens / spec_s) / (bs * steps / off_s)
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=24)
    ap.add_argument("--steps", type=int, default=300, help="steps per batch size (a sweep row here: 250-700)")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--baseline", help="git revision whose serving/adaptive.py to simulate instead")
    args = ap.parse_args()
    cls = load_policy(args.baseline)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    runs = [run(cls, s, sizes, args.steps) for s in range(args.seeds)]
    print("| bs | mean × always-off | worst |")
    print("|---|---|---|")
    for bs in sizes:
        r = [x[bs] for x in runs]
        print(f"| {bs} | {statistics.fmean(r):.3f} | {min(r):.3f} |")


if __name__ == "__main__":
    main()
