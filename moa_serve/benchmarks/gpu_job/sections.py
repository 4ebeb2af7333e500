"""The job's measuring sections: greedy identity, batch size 1 (methods and transformers `generate`
interleaved), the batch sweep. Each takes the deadline and stops adding measurements when the next
would not fit."""

from __future__ import annotations

import time
from dataclasses import asdict

from moa_serve.benchmarks.bench import (
    MethodResult,
    add_runner,
    bench_drafter,
    engine_runner,
    markdown_table,
    run_interleaved,
)

from .config import Deadline, GpuJobConfig, JobMethod, log, tests_reserve


def generate_outputs(target, drafter, tree, prompts: list[list[int]], sp, bs: int, fallbacks: list) -> list[list[int]]:
    """Greedy outputs of one engine serving the prompts bs at a time (Engine.generate per group)."""
    from serving.config import EngineConfig
    from serving.engine import Engine

    kv = sum(map(len, prompts)) + len(prompts) * (sp.max_new_tokens + tree.num_draft_tokens + 2) + 64
    engine = Engine(
        target,
        drafter,
        EngineConfig(tree=tree, kv_slots=kv, prefix_cache=False),  # (repeated prompts: moa_serve/benchmarks/bench.py)
        on_fallback=lambda r, why: fallbacks.append(why),
    )
    outs: list[list[int]] = []
    for i in range(0, len(prompts), bs):
        outs += [r.output_ids for r in engine.generate(prompts[i : i + bs], sp)]
    return outs


def identity_section(c: GpuJobConfig, target, methods: list[JobMethod], prompts, sp, deadline: Deadline) -> dict:
    """Each loaded drafter's greedy tokens against vanilla's at each batch size (same prompts, same
    device); also whether vanilla's own tokens are the same at every batch size (batch invariance)."""
    from sglang_ext.tree import TreeShape

    prompts = prompts[: c.identity_prompts]
    runs = [JobMethod("vanilla", "vanilla", TreeShape.chain(1))] + [m for m in methods if not m.skipped]
    ref: dict[int, list[list[int]]] = {}
    rows, last = [], 0.0
    for m in runs:
        if not deadline.allows(f"identity {m.label}", 1.5 * last + tests_reserve(c)):
            break
        t0 = time.perf_counter()
        for bs in c.identity_batch_sizes:
            row = {"method": m.label, "tree": m.tree.label, "batch_size": bs, "prompts": len(prompts), "error": None}
            fallbacks: list[str] = []
            try:
                drafter = bench_drafter(m.source, target) if m.drafter is not None else None  # one per engine
                outs = generate_outputs(target, drafter, m.tree, prompts, sp, bs, fallbacks)
            except Exception as e:  # noqa: BLE001 - reported in the row
                rows.append({**row, "error": f"{type(e).__name__}: {e}"})
                continue
            if m.label == "vanilla":
                ref[bs] = outs
            row["identical"] = sum(a == b for a, b in zip(outs, ref.get(bs, [])))
            row["tokens"] = sum(map(len, outs))
            row["fallbacks"], row["fallback_reason"] = len(fallbacks), fallbacks[0] if fallbacks else None
            rows.append(row)
        last = time.perf_counter() - t0
    first = ref.get(c.identity_batch_sizes[0])
    return {
        "prompts": len(prompts),
        "batch_sizes": list(c.identity_batch_sizes),
        "rows": rows,
        "vanilla_same_at_every_batch_size": None if first is None else all(o == first for o in ref.values()),
    }


def _eos_ids(target) -> list[int]:
    eos = getattr(target.tokenizer, "eos_token_id", None)
    return sorted(set(target.cfg.eos_token_ids) | ({eos} if eos is not None else set()))


def _set_runners(target, methods: list[JobMethod], set_name: str, sp, hf_cache: dict, fallbacks: dict) -> dict:
    """The runners of one eval set: vanilla, each drafter (skipped ones as rows with the reason) and
    transformers `generate` on the target's device and dtype."""
    from moa_serve.benchmarks import peers
    from sglang_ext.tree import TreeShape

    runners: dict = {}
    add_runner(
        runners,
        MethodResult("vanilla", set_name, "-"),
        lambda: engine_runner(target, "vanilla", TreeShape.chain(1), sp),
    )
    for m in methods:
        res = MethodResult(m.label, set_name, m.tree.label)
        if m.skipped:
            res.error = m.skipped
            runners[f"{m.label} {m.tree.label}"] = (res, None)
            continue
        log = fallbacks.setdefault(m.label, [])
        add_runner(
            runners,
            res,
            lambda m=m, log=log: engine_runner(target, m.source, m.tree, sp, lambda r, why: log.append(why)),
        )

    def hf():
        model = peers.load_hf_model(target, target.model.dtype, hf_cache, target.model.device)
        return peers.hf_runner(model, sp, _eos_ids(target))

    add_runner(runners, MethodResult("hf-generate", set_name, "-"), hf)
    return runners


def bs1_section(
    c: GpuJobConfig, target, methods: list[JobMethod], prompts_by_set: dict, sp, deadline: Deadline
) -> dict:
    """Per eval set, every method (and the peer) on the set's first num_prompts prompts, interleaved
    prompt by prompt; rows per set and pooled over sets (tokens / seconds summed)."""
    results: list[MethodResult] = []
    hf_cache: dict = {}
    fallbacks: dict[str, list[str]] = {}
    last = 0.0
    for set_name, prompts in prompts_by_set.items():
        if not deadline.allows(f"bs1 eval set {set_name}", 1.5 * last + tests_reserve(c)):
            break
        t0 = time.perf_counter()
        runners = _set_runners(target, methods, set_name, sp, hf_cache, fallbacks)
        run_interleaved({k: v for k, v in runners.items() if v[1] is not None}, prompts[: c.num_prompts])
        vanilla = runners["vanilla -"][0]
        for res, _ in runners.values():
            res.identical = sum(a == b for a, b in zip(res.outputs, vanilla.outputs))
            results.append(res)
            rate = f"{res.tokens_per_s:.1f} tok/s tau {res.tau:.2f}"
            log(f"bs1 {set_name} {res.method} {res.tree}: {rate} {res.error or ''}")
        last = time.perf_counter() - t0
    hf_cache.clear()  # the transformers copy is not part of the sweep: free it
    return {
        "eval_sets": list(dict.fromkeys(r.eval_set for r in results)),
        "prompts_per_set": c.num_prompts,
        "pooled": pooled_rows(results, fallbacks),
        "rows": [_result_row(r) for r in results],
        "table": markdown_table(results) if results else "",
    }


def _result_row(r: MethodResult) -> dict:
    row = {k: v for k, v in asdict(r).items() if k != "outputs"}
    return {**row, "tokens_per_s": r.tokens_per_s, "tau": r.tau, "draft_per_step": r.draft_per_step}


def pooled_rows(results: list[MethodResult], fallbacks: dict[str, list[str]]) -> list[dict]:
    """Per (method, tree): counters summed over eval sets; ratio to vanilla's pooled tok/s."""
    pooled: dict[tuple[str, str], MethodResult] = {}
    for r in results:
        p = pooled.setdefault((r.method, r.tree), MethodResult(r.method, "all", r.tree))
        if r.error:
            p.error = p.error or r.error
            continue
        for k in ("tokens", "seconds", "verify_steps", "accepted", "drafted", "identical", "prompts"):
            setattr(p, k, getattr(p, k) + getattr(r, k))
    vanilla = pooled.get(("vanilla", "-"))
    v_rate = vanilla.tokens_per_s if vanilla and vanilla.prompts else float("nan")
    rows = []
    for (method, tree), p in pooled.items():
        measured = p.prompts > 0
        rows.append(
            {
                "method": method,
                "tree": tree,
                "prompts": p.prompts,
                "tokens": p.tokens,
                "seconds": p.seconds,
                "tokens_per_s": p.tokens_per_s if measured else None,
                "ratio_vs_vanilla": p.tokens_per_s / v_rate if measured else None,
                "tau": p.tau if p.verify_steps else None,
                "draft_per_step": p.draft_per_step if p.verify_steps else None,
                "identical": p.identical,
                "fallbacks": len(fallbacks.get(method, [])),
                "fallback_reason": (fallbacks.get(method) or [None])[0],
                "error": None if measured else p.error,
                "skipped": bool(p.error and p.error.startswith("skipped:")),
            }
        )
    return rows


def best_drafter(pooled: list[dict], methods: list[JobMethod]) -> JobMethod | None:
    """The drafter with the highest bs-1 tok/s ratio to vanilla (None when none was measured)."""
    by_label = {m.label: m for m in methods if not m.skipped}
    rated = [r for r in pooled if r["method"] in by_label and r["ratio_vs_vanilla"] is not None]
    return by_label[max(rated, key=lambda r: r["ratio_vs_vanilla"])["method"]] if rated else None


def _recorded(run, outputs: dict[int, list[list[int]]], max_new: int):
    """engine_batch_runner's runner, keeping each full-length run's outputs by batch size (in queue order)."""
    from moa_serve.benchmarks.batch import drive

    def steps(prompts, max_new_tokens: int = max_new, concurrency: int | None = None):
        res = yield from run.steps(prompts, max_new_tokens, concurrency)
        if max_new_tokens == max_new:  # measured runs, not the short warm-ups
            outputs[concurrency or len(prompts)] = res.outputs
        return res

    def call(prompts, max_new_tokens: int = max_new, concurrency: int | None = None):
        return drive(steps(prompts, max_new_tokens, concurrency))

    call.steps, call.release = steps, run.release  # type: ignore[attr-defined]
    return call


def _sweep_entries(target, best: JobMethod | None, max_new: int, sp) -> list[tuple]:
    """(label, tree text, adaptive, runner or the exception that building it raised, its outputs by bs).
    Each entry builds its own drafter: two engines stepping one drafter in turn would mix requests."""
    from moa_serve.benchmarks.batch import engine_batch_runner
    from sglang_ext.tree import TreeShape

    plan = [("vanilla", "vanilla", TreeShape.chain(1), False)]
    if best is not None:
        plan += [(best.label, best.source, best.tree, False), (best.label, best.source, best.tree, True)]
    entries = []
    for label, source, tree, adaptive in plan:
        outputs: dict[int, list[list[int]]] = {}
        try:
            run = _recorded(engine_batch_runner(target, source, tree, max_new, adaptive, {}, sp), outputs, max_new)
        except Exception as e:  # noqa: BLE001 - the sweep reports it in the entry's rows
            run = e
        entries.append((label, "-" if label == "vanilla" else tree.label, adaptive, run, outputs))
    return entries


def _built(run):
    """A make_runner for run_batch_sweep that hands over an already built runner (or re-raises its error)."""

    def make():
        if isinstance(run, Exception):
            raise run
        return run

    return make


def sweep_section(
    c: GpuJobConfig, target, best: JobMethod | None, prompts: list[list[int]], sp, deadline: Deadline
) -> dict:
    """Vanilla, the best drafter and the best drafter with adaptive speculation at each batch size, one
    batch size at a time (so the deadline can stop between them); runners are built once, so the
    adaptive policy carries what it learned from one batch size to the next, as in a server."""
    from moa_serve.benchmarks.batch import batch_grid_table, batch_json, run_batch_sweep

    entries = _sweep_entries(target, best, c.max_new_tokens, sp)
    methods = [(label, tree, adaptive, _built(run)) for label, tree, adaptive, run, _ in entries]
    rows, last, done = [], 0.0, []
    for b in c.batch_sizes:
        if not deadline.allows(f"sweep batch size {b}", 2.0 * last + tests_reserve(c)):
            break
        t0 = time.perf_counter()
        rows += run_batch_sweep(
            methods,
            prompts,
            [b],
            warmup_tokens=min(16, c.max_new_tokens),
            measure_memory=False,
            log=log,
            min_prompts=c.sweep_min_prompts,
        )
        done.append(b)
        last = time.perf_counter() - t0
    ref = entries[0][4]
    identity = [
        {
            "method": label,
            "adaptive": adaptive,
            "batch_size": b,
            "identical": sum(x == y for x, y in zip(outs, ref[b])),
            "prompts": len(outs),
        }
        for label, _, adaptive, _, by_bs in entries[1:]
        for b, outs in by_bs.items()
        if b in ref
    ]
    return {
        "best_drafter": None if best is None else {"method": best.label, "tree": best.tree.label},
        "batch_sizes": done,
        "min_prompts": c.sweep_min_prompts,
        "rows": batch_json(rows),
        "identity": identity,
        "table": batch_grid_table(rows) if rows else "",
    }
