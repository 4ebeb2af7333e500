"""Vanilla vs each drafter (and peers) on the same prompts, in one run.

Every speed figure is a ratio to the vanilla row measured in the same run (machines are noisy).
tau = mean (accepted + 1) per verify step, pooled over all verify steps of a method.
Acceptance by draft position i = the fraction of a method's verify steps whose draft token at depth i
was accepted (so it falls with i; position 1 is the chance the first draft token is right).
Peers (transformers, llama.cpp) run interleaved with our methods: moa_serve/benchmarks/peers.py.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch


def acceptance_by_position(accepted_by_depth: list[int], verify_steps: int, depth: int = 0) -> list[float]:
    """accepted_by_depth[i] = verify steps that accepted draft position i+1 -> fraction of all verify
    steps, for positions 1..max(depth, deepest accept)."""
    if not verify_steps:
        return []
    n = max(depth, len(accepted_by_depth))
    return [(accepted_by_depth[i] if i < len(accepted_by_depth) else 0) / verify_steps for i in range(n)]


def add_counts(total: list[int], more: list[int]) -> None:
    """Element-wise total += more, growing total as needed (per-position accept counts)."""
    total += [0] * (len(more) - len(total))
    for i, n in enumerate(more):
        total[i] += n


def tree_depth(tree_text: str) -> int:
    """Depth from a "d,k,n" tree column (0 for "-" or a peer's description)."""
    head = tree_text.split(",")[0]
    return int(head) if head.isdigit() else 0


class SpecRates:
    """Rates every benchmark row derives from its counters
    (tokens, seconds, verify_steps, accepted, drafted, accepted_by_depth)."""

    @property
    def acceptance_by_position(self) -> list[float]:
        return acceptance_by_position(
            self.accepted_by_depth, self.verify_steps, max(getattr(self, "depth", 0), tree_depth(self.tree))
        )

    @property
    def tau(self) -> float:
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")

    @property
    def draft_per_step(self) -> float:
        return self.drafted / self.verify_steps if self.verify_steps else float("nan")


@dataclass
class MethodResult(SpecRates):
    method: str
    eval_set: str
    tree: str
    tokens: int = 0
    seconds: float = 0.0
    verify_steps: int = 0
    accepted: int = 0
    drafted: int = 0
    identical: int = 0  # prompts whose output equals vanilla's
    prompts: int = 0
    error: str | None = None  # "skipped: why" for a peer that cannot run here, else the exception
    accepted_by_depth: list[int] = field(default_factory=list)  # verify steps that accepted draft position i+1
    depth: int = 0  # draft positions to report: the tree depth, or a peer's longest draft
    outputs: list[list[int]] = field(default_factory=list, repr=False)


def bench_drafter(method: str, target):
    """make_drafter, with online learning off: a benchmark repeats its prompts (warm-up, repeats),
    so a drafter that learns from served outputs would be scored on answers it has already seen."""
    from sglang_ext.drafters import make_drafter

    drafter = make_drafter("none" if method == "vanilla" else method, target)
    if drafter is not None:
        drafter.stop_learning()  # (a merged drafter's members too)
    return drafter


def engine_runner(target, method: str, tree, sp, on_fallback=None):
    """A function prompt -> (output ids, stats) running our engine with one drafter (or none); sp: SamplingParams.
    on_fallback(request, reason): called when a drafter fault sends a request back to vanilla decoding."""
    from serving.config import EngineConfig
    from serving.engine import Engine

    # NOTE: no prefix cache: a benchmark repeats its prompts, and measures prefill + decoding (docs/BENCHMARKS.md
    # "Prefix cache" measures the cache)
    config = EngineConfig(tree=tree, prefix_cache=False)
    engine = Engine(target, bench_drafter(method, target), config, on_fallback=on_fallback)

    def run(prompt):
        r = engine.generate([prompt], sp)[0]
        return r.output_ids, r.stats

    return run


def add_runner(runners: dict, res: MethodResult, make) -> None:
    """Build a method's runner; one that cannot be built is kept as a row with the reason (a peer that
    is not available here: "skipped: why"), never dropped."""
    from moa_serve.benchmarks.peers import PeerUnavailable

    try:
        runners[f"{res.method} {res.tree}"] = (res, make())
    except PeerUnavailable as e:
        res.error = f"skipped: {e}"
        runners[f"{res.method} {res.tree}"] = (res, None)
    except Exception as e:  # noqa: BLE001 - e.g. an unknown drafter: reported in the table
        res.error = f"{type(e).__name__}: {e}"
        runners[f"{res.method} {res.tree}"] = (res, None)


def run_interleaved(runners: dict[str, tuple[MethodResult, object]], prompts: list[list[int]], warmup: int = 1) -> None:
    """Every prompt runs through every method before the next prompt, so load changes on a noisy
    machine hit all methods alike. A method that raises is marked failed and skipped from then on."""
    for res, run in runners.values():
        try:
            for p in prompts[:warmup]:
                run(p[: min(len(p), 64)])
        except Exception as e:  # noqa: BLE001 - a failing method is reported, not dropped
            res.error = f"{type(e).__name__}: {e}"
    for p in prompts:
        for res, run in runners.values():
            if res.error:
                continue
            try:
                t0 = time.perf_counter()
                out, st = run(p)
                res.seconds += time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001
                res.error = f"{type(e).__name__}: {e}"
                continue
            res.tokens += len(out)
            res.outputs.append(out)
            res.prompts += 1
            if st is not None:
                res.verify_steps += st.verify_steps
                res.accepted += st.accepted_tokens
                res.drafted += st.draft_tokens
                add_counts(res.accepted_by_depth, getattr(st, "accepted_by_depth", []))
                res.depth = max(res.depth, getattr(st, "max_draft", 0))  # peers: their longest draft


def _error_cell(error: str) -> str:
    return error if error.startswith("skipped:") else f"failed: {error}"


def markdown_table(results: list[MethodResult], sampling: bool = False) -> str:
    """sampling: outputs of different methods differ by design (different random draws), so the
    "same as vanilla" column says n/a."""
    lines = [
        "| eval set | method | tree (d,k,n) | τ | draft tok/step | tok/s | speedup vs vanilla | same as vanilla |",
        "|---|---|---|---|---|---|---|---|",
    ]
    vanilla = {r.eval_set: r for r in results if r.method == "vanilla" and not r.error}
    for r in results:
        if r.error:
            lines.append(f"| {r.eval_set} | {r.method} | {r.tree} | {_error_cell(r.error)} | | | | |")
            continue
        v = vanilla.get(r.eval_set)
        speed = f"{r.tokens_per_s / v.tokens_per_s:.2f}×" if v else "n/a"
        same = "-" if not v or r.method == "vanilla" else "n/a (sampling)" if sampling else f"{r.identical}/{r.prompts}"
        tau = f"{r.tau:.2f}" if r.verify_steps else "-"
        dps = f"{r.draft_per_step:.1f}" if r.verify_steps else "-"
        lines.append(
            f"| {r.eval_set} | {r.method} | {r.tree} | {tau} | {dps} | {r.tokens_per_s:.1f} | {speed} | {same} |"
        )
    return "\n".join(lines)


ACCEPT_COLUMNS = 10  # the markdown table shows this many draft positions; results.json has them all


def acceptance_table(results: list[MethodResult]) -> str:
    """Rows with verify steps (speculative methods and peers): fraction of verify steps accepting position i."""
    rows = [r for r in results if not r.error and r.verify_steps and r.method != "vanilla" and r.acceptance_by_position]
    if not rows:
        return ""
    n = min(ACCEPT_COLUMNS, max(len(r.acceptance_by_position) for r in rows))
    lines = [
        "| eval set | method | tree (d,k,n) | verify steps | " + " | ".join(f"pos {i + 1}" for i in range(n)) + " |",
        "|---|---|---|---|" + "---|" * n,
    ]
    for r in rows:
        acc = r.acceptance_by_position
        lines.append(
            f"| {r.eval_set} | {r.method} | {r.tree} | {r.verify_steps} | "
            + " | ".join(f"{acc[i]:.2f}" if i < len(acc) else "" for i in range(n))
            + " |"
        )
    return "\n".join(lines)


def pooled_acceptance(results: list[MethodResult]) -> dict[str, list[float]]:
    """Per method (and tree), acceptance by position pooled over eval sets (counts summed, then divided)."""
    pooled: dict[str, tuple[list[int], int, int]] = {}
    for r in results:
        if r.error or not r.verify_steps or r.method == "vanilla":
            continue
        key = r.method + (f" {r.tree}" if r.tree != "-" else "")
        by, steps, depth = pooled.get(key, ([], 0, 0))
        add_counts(by, r.accepted_by_depth)
        pooled[key] = (by, steps + r.verify_steps, max(depth, r.depth, tree_depth(r.tree)))
    return {k: acceptance_by_position(by, steps, depth) for k, (by, steps, depth) in pooled.items()}


def plot_acceptance(results: list[MethodResult], path) -> bool:
    """PNG: acceptance rate by draft position, one line per method; False when no row has verify steps."""
    curves = {k: v for k, v in pooled_acceptance(results).items() if v}
    if not curves:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, acc in curves.items():
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=key)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("draft position (depth in the tree / chain)")
    ax.set_ylabel("fraction of verify steps accepting it")
    ax.set_ylim(0, 1)
    ax.set_title("Acceptance rate by draft position")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_tau_by_set(results: list[MethodResult], path) -> bool:
    """PNG: τ per eval set, one bar group per set, one bar per speculative method; False if none."""
    rows = [r for r in results if not r.error and r.verify_steps and r.method != "vanilla"]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(dict.fromkeys(r.eval_set for r in rows))
    methods = list(dict.fromkeys(r.method for r in rows))
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(sets)), 4.5))
    for j, m in enumerate(methods):
        tau = {r.eval_set: r.tau for r in rows if r.method == m}
        ax.bar([i + j * width for i in range(len(sets))], [tau.get(s, 0) for s in sets], width, label=m)
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(sets))], sets)
    ax.set_ylabel("τ (accepted + 1 per verify step)")
    ax.set_title("Acceptance length per eval set")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def machine_description() -> str:
    import os

    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"Python {platform.python_version()}, no GPU"
    )
