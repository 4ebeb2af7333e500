"""`moa-serve bench --batch-sizes ...`: throughput vs batch size (the gateway's own cost, `--gateway-overhead`:
overhead.py).

Batch sweep: for each batch size B, every method (vanilla, then each drafter) serves the same queue
of prompts (sweep_prompts: at least 2B) through the Engine with B requests running at a time, a
finished request's place going to the next prompt (continuous batching, as the server does). Methods
run interleaved engine step by engine step (each timed on its own steps), so load drift on a noisy
machine hits all alike, and every speedup is against the vanilla row of the SAME batch size in the
SAME run.
Two rates per row: the whole run (the tail where the last requests drain included) and the rate at
full batch (steps with B requests in the engine: a server under a steady load of B clients).

Peak memory: the process's resident set size (psutil RSS), sampled every 5 ms by a thread while the
row's measured runs. We report the peak and its rise over the RSS at the start of the measured run. The
model weights are in every row's peak; the engine's KV pool is allocated at the warm-up (zeroed pages
count once touched); memory the allocator keeps after an earlier, bigger row is not counted again as a rise.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from moa_serve.benchmarks.bench import SpecRates, add_counts


@dataclass
class BatchResult(SpecRates):
    method: str
    tree: str
    batch_size: int
    adaptive: bool = False
    tokens: int = 0
    seconds: float = 0.0
    verify_steps: int = 0  # summed over requests (each request's verify steps)
    accepted: int = 0
    drafted: int = 0
    decode_steps: int = 0  # engine steps that decoded (one batched verify forward each)
    batch_sum: int = 0  # requests decoded, summed over those steps (mean running batch = batch_sum / decode_steps)
    fallbacks: int = 0  # requests that fell back to vanilla (drafter fault)
    decode_seconds: float = 0.0  # time in steps that decoded (the prefill-only first step excluded)
    decode_tokens: int = 0  # tokens those steps emitted (the first token per request comes from prefill)
    full_seconds: float = 0.0  # time in steps that had b requests in the engine (steady state, no drain tail)
    full_tokens: int = 0  # tokens those steps emitted (arrivals' first tokens included)
    runs: int = 0
    peak_rss_mb: float | None = None
    rss_rise_mb: float | None = None
    error: str | None = None
    accepted_by_depth: list[int] = field(default_factory=list)  # verify steps that accepted draft position i+1

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else float("nan")

    @property
    def full_tokens_per_s(self) -> float:
        """Throughput while b requests are in the engine: a server under a steady load of b clients.
        The whole-run rate also counts the tail where the last requests drain (the batch shrinks),
        which depends on how many prompts the benchmark pushes, not on the engine."""
        return self.full_tokens / self.full_seconds if self.full_seconds else float("nan")

    @property
    def mean_batch(self) -> float:
        return self.batch_sum / self.decode_steps if self.decode_steps else float("nan")

    @property
    def key(self) -> str:
        return self.method + (f" {self.tree}" if self.tree != "-" else "") + (" adaptive" if self.adaptive else "")


@dataclass
class BatchRun:
    """What one batch run returned (a runner's result)."""

    tokens: int
    verify_steps: int = 0
    accepted: int = 0
    drafted: int = 0
    decode_steps: int = 0
    batch_sum: int = 0
    fallbacks: int = 0
    decode_seconds: float = 0.0
    decode_tokens: int = 0
    full_seconds: float = 0.0
    full_tokens: int = 0
    seconds: float | None = None  # the run's own time when interleaved with others (None: wall time counts)
    accepted_by_depth: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list, repr=False)


class RSSSampler:
    """Peak process RSS while the `with` block runs (a thread polls psutil every `interval` s)."""

    def __init__(self, interval: float = 0.005):
        import psutil

        self.proc, self.interval = psutil.Process(), interval
        self.start = self.peak = 0
        self._stop = threading.Event()

    def _poll(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __enter__(self) -> RSSSampler:
        self.start = self.peak = self.proc.memory_info().rss
        self._thread = threading.Thread(target=self._poll, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


def drive(gen) -> BatchRun:
    """Run a step generator to the end; its return value."""
    try:
        while True:
            next(gen)
    except StopIteration as stop:
        return stop.value


def interleave(gens: list) -> list:
    """Step several runs round-robin (one engine step each in turn) until all finish: drift on a
    noisy machine then hits every method alike at step granularity, not row by row. Each entry of
    the result is the run's BatchRun, or the exception that ended it (the others go on)."""
    out: list = [None] * len(gens)
    live = list(range(len(gens)))
    while live:
        for i in list(live):
            try:
                next(gens[i])
            except StopIteration as stop:
                out[i] = stop.value
                live.remove(i)
            except Exception as e:  # noqa: BLE001 - reported in that method's row
                out[i] = e
                live.remove(i)
    return out


def _step_generator(runner, queue: list[list[int]], b: int):
    """The runner's step generator; a runner without one runs whole as a single step (wall time)."""
    if hasattr(runner, "steps"):
        return runner.steps(queue, concurrency=b)

    def whole():
        t0 = time.perf_counter()
        out = runner(queue, concurrency=b)
        if out.seconds is None:
            out.seconds = time.perf_counter() - t0
        return out
        yield  # never reached: makes this a generator

    return whole()


def batch_prompts(prompts: list[list[int]], b: int, start: int = 0) -> list[list[int]]:
    """B prompts: the eval prompts in order from `start`, cycled when there are fewer than B."""
    return [prompts[(start + i) % len(prompts)] for i in range(b)]


def sweep_prompts(prompts: list[list[int]], b: int, min_prompts: int, rounds: int = 2) -> list[list[int]]:
    """The prompts one measured run at batch size b pushes through the engine, b at a time
    (continuous batching: a finished request's place goes to the next prompt): at least
    min_prompts, and `rounds` x b so the run is mostly at full batch rather than in the tail where
    the batch drains. Eval prompts in order, cycled when there are fewer."""
    return batch_prompts(prompts, max(min_prompts, rounds * b, b))


class _SweepEngines:
    """A method's Engine for the current batch size (engine_batch_runner), and the adaptive policy
    that outlives it.

    The engine (and its KV pool, sized for b of the longest prompts at the full max_new_tokens) is
    kept while the batch size stays the same, so the warm-up and the measured runs of a row share
    it; a new batch size builds a new one. Adaptive speculation keeps what it learned, as in a server
    whose load changes: its measurements per batch bucket, and the acceptance and step costs behind
    its prior (kept here, not only in the engine: the engine is released after each batch size)."""

    def __init__(self, engine_cls, target, drafter, tree, max_new_tokens: int, adaptive: bool):
        self.engine_cls, self.target, self.drafter, self.tree = engine_cls, target, drafter, tree
        self.max_new_tokens, self.adaptive = max_new_tokens, adaptive and drafter is not None
        self.engine, self.b, self.policy = None, None, None
        self.fallbacks: list[str] = []

    def get(self, prompts: list[list[int]], b: int):
        from serving.config import EngineConfig

        longest = sorted((len(p) for p in prompts), reverse=True)[:b]
        need = sum(n + self.max_new_tokens + self.tree.num_draft_tokens + 2 for n in longest) + 64
        e = self.engine
        if e is None or self.b != b or e.kv.num_slots < need:
            self.engine = None  # free the old pool first
            # (no prefix cache: the sweep repeats its prompts; moa_serve/benchmarks/bench.py engine_runner)
            config = EngineConfig(tree=self.tree, kv_slots=2 * need, adaptive=self.adaptive, prefix_cache=False)
            e = self.engine_cls(
                self.target, self.drafter, config, on_fallback=lambda r, why: self.fallbacks.append(why)
            )
            if self.policy is not None:
                e.policy = self.policy
            self.engine, self.b, self.policy = e, b, e.policy
        return e

    def release(self) -> None:
        """After the last run at a batch size."""
        self.engine, self.b = None, None


def engine_batch_runner(
    target, method: str, tree, max_new_tokens: int, adaptive: bool, drafter_cache: dict, sampling=None
) -> Callable:
    """A function (prompts, max_new_tokens, concurrency) -> BatchRun running the prompts through an
    Engine with at most `concurrency` requests running (default: all at once), refilled as they finish.

    sampling: a SamplingParams whose temperature / top-p / seed every request uses (default greedy).
    One engine per batch size, one adaptive policy across them (_SweepEngines). The drafter is built
    once per method and reused. The engine class is looked up when the runner is built."""
    from moa_serve.benchmarks.bench import bench_drafter
    from serving.engine import Engine
    from sglang_ext.sampling import SamplingParams

    if method != "vanilla" and method not in drafter_cache:
        drafter_cache[method] = bench_drafter(method, target)  # raises for an unknown drafter: reported
    drafter = drafter_cache.get(method) if method != "vanilla" else None
    engines = _SweepEngines(Engine, target, drafter, tree, max_new_tokens, adaptive)

    def steps(prompts: list[list[int]], max_new: int = max_new_tokens, concurrency: int | None = None):
        """A generator: one engine step per next(); returns the BatchRun (StopIteration.value)."""
        b = concurrency or len(prompts)
        engine = engines.get(prompts, b)
        engines.fallbacks.clear()
        sp = SamplingParams(max_new_tokens=max_new) if sampling is None else replace(sampling, max_new_tokens=max_new)
        res = yield from _serve_queue(engine, list(prompts), b, sp)
        res.fallbacks = len(engines.fallbacks)
        return res

    def run(prompts: list[list[int]], max_new: int = max_new_tokens, concurrency: int | None = None) -> BatchRun:
        return drive(steps(prompts, max_new, concurrency))

    run.steps = steps  # type: ignore[attr-defined]  # for interleaved sweeps
    run.release = engines.release  # type: ignore[attr-defined]  # after the last run at a batch size
    run.policy = lambda: engines.policy  # type: ignore[attr-defined]  # the adaptive policy (None when not adaptive)
    return run


def _serve_queue(engine, todo: list[list[int]], b: int, sp):
    """A generator: one engine step per next(), at most b requests in the engine, refilled from `todo`
    as they finish; returns the BatchRun. res.seconds counts only the time between resumptions, so a
    sweep can interleave methods step by step and each still gets its own time."""
    reqs, res = [], BatchRun(0, seconds=0.0)
    try:
        while True:
            t_in = time.perf_counter()
            live = sum(not r.finished for r in reqs)  # requests in the engine
            while todo and live < b:
                reqs.append(engine.add_request(todo.pop(0), sp))
                live += 1
            if not live:
                break
            decoding = {r.rid for r in engine.running}  # requests this step decodes (arrivals only prefill)
            t0 = time.perf_counter()
            events = engine.step()
            dt = time.perf_counter() - t0
            if live == b:
                res.full_seconds += dt
                res.full_tokens += sum(len(e.new_tokens) for e in events)
            if decoding:
                res.decode_seconds += dt  # NOTE: includes any arrival's prefill in the step
                res.decode_tokens += sum(len(e.new_tokens) for e in events if e.request.rid in decoding)
                res.decode_steps += 1
                res.batch_sum += len(decoding)
            res.seconds += time.perf_counter() - t_in
            yield
    finally:
        for r in reqs:
            if not r.finished:
                engine.abort(r)
    for r in reqs:
        res.tokens += len(r.output_ids)
        res.verify_steps += r.stats.verify_steps
        res.accepted += r.stats.accepted_tokens
        res.drafted += r.stats.draft_tokens
        add_counts(res.accepted_by_depth, getattr(r.stats, "accepted_by_depth", []))
        res.outputs.append(r.output_ids)
    return res


def run_batch_sweep(
    methods: list[tuple[str, str, bool, Callable[[], Callable]]],
    prompts: list[list[int]],
    batch_sizes: list[int],
    repeats: int = 1,
    warmup: bool = True,
    warmup_tokens: int = 16,
    measure_memory: bool = True,
    log=None,
    min_prompts: int = 1,
    interleaved: bool = True,
) -> list[BatchResult]:
    """methods: (label, tree text, adaptive, make_runner); a runner is (prompts, max_new, concurrency) -> BatchRun.

    Per batch size b, every method runs (warm-up once on b prompts, then `repeats` measured runs,
    method order rotated each repeat); a measured run serves the same prompt list (sweep_prompts:
    at least min_prompts and 2b) with b requests running at a time, as the server does. Runners
    with a `steps` generator run interleaved, one engine step each in turn (each timed on its own
    steps; the RSS peak then covers all of them); others run one after another. A method
    that fails to build, or fails at some batch size, gets a row with the error at that batch size
    (it is still tried at the others)."""
    runners: dict[int, Callable | None] = {}  # (prompts, max_new, concurrency) -> BatchRun
    build_errors: dict[int, str] = {}
    for i, (_, _, _, make) in enumerate(methods):
        try:
            runners[i] = make()
        except Exception as e:  # noqa: BLE001 - e.g. an unknown drafter: reported in every row
            runners[i], build_errors[i] = None, f"{type(e).__name__}: {e}"
    results: list[BatchResult] = []
    for b in batch_sizes:
        queue = sweep_prompts(prompts, b, min_prompts)
        rows = {
            i: BatchResult(label, tree, b, adaptive, error=build_errors.get(i))
            for i, (label, tree, adaptive, _) in enumerate(methods)
        }
        if warmup:  # the same batch, few new tokens (warms the engine and the adaptive policy)
            _warm_up(rows, runners, queue[:b], warmup_tokens)
        for rep in range(repeats):
            _measured_runs(rows, runners, queue, b, rep, interleaved, measure_memory)
        for r in runners.values():
            if r is not None and hasattr(r, "release"):
                r.release()
        for row in rows.values():
            results.append(row)
            if log:
                log(
                    f"bs={b} {row.key}: {row.tokens_per_s:.1f} tok/s ({row.full_tokens_per_s:.1f} at full batch) tau "
                    f"{row.tau:.2f} {row.error or ''}"
                )
    return results


def _warm_up(rows: dict[int, BatchResult], runners: dict, batch: list[list[int]], tokens: int) -> None:
    for i, row in rows.items():
        if row.error:
            continue
        try:
            runners[i](batch, tokens)
        except Exception as e:  # noqa: BLE001 - a failing method is reported, not dropped
            row.error = f"{type(e).__name__}: {e}"


def _measured_runs(
    rows: dict[int, BatchResult],
    runners: dict,
    queue: list[list[int]],
    b: int,
    rep: int,
    interleaved: bool,
    memory: bool,
) -> None:
    """Repeat `rep` at batch size b: every live method serves `queue`, the method order rotated by rep;
    stepped runners interleaved as one group, the others one at a time."""
    order = list(rows)
    rot = order[rep % len(order) :] + order[: rep % len(order)] if order else []
    live = [i for i in rot if not rows[i].error]
    stepped = [i for i in live if interleaved and hasattr(runners[i], "steps")]
    groups = ([stepped] if stepped else []) + [[i] for i in live if i not in stepped]
    for group in groups:
        sampler = RSSSampler() if memory else None
        try:
            if sampler:
                sampler.__enter__()
            outs = dict(zip(group, interleave([_step_generator(runners[i], queue, b) for i in group])))
        finally:
            if sampler:
                sampler.__exit__(None, None, None)
        for i, out in outs.items():
            _add_run(rows[i], out, sampler)


_SUMMED = (  # BatchRun counters a row adds up over its runs
    "tokens",
    "verify_steps",
    "accepted",
    "drafted",
    "decode_steps",
    "batch_sum",
    "fallbacks",
    "decode_seconds",
    "decode_tokens",
    "full_seconds",
    "full_tokens",
)


def _add_run(row: BatchResult, out, sampler) -> None:
    """A measured run's BatchRun (or the exception that ended it) into its row."""
    if isinstance(out, Exception):
        row.error = f"{type(out).__name__}: {out}"
        return
    row.seconds += out.seconds
    row.runs += 1
    for f in _SUMMED:
        setattr(row, f, getattr(row, f) + getattr(out, f))
    add_counts(row.accepted_by_depth, out.accepted_by_depth)
    if sampler:
        mb = 1 << 20
        row.peak_rss_mb = max(row.peak_rss_mb or 0.0, sampler.peak / mb)
        row.rss_rise_mb = max(row.rss_rise_mb or 0.0, (sampler.peak - sampler.start) / mb)


def speedup(row: BatchResult, results: list[BatchResult], steady: bool = False) -> float | None:
    """tokens/s of `row` over the vanilla row of the same batch size (None if that failed or is absent);
    steady: the rates at full batch (BatchResult.full_tokens_per_s) instead of the whole run's."""
    v = next(
        (r for r in results if r.method == "vanilla" and r.batch_size == row.batch_size and not r.error and r.runs),
        None,
    )
    if v is None or row.error or not row.runs:
        return None
    if steady:
        x = row.full_tokens_per_s / v.full_tokens_per_s
        return None if x != x else x
    return row.tokens_per_s / v.tokens_per_s


def fmt(x: float | None, spec: str = ".2f") -> str:
    """A table cell: the number, or - when there is none (None, NaN)."""
    return "-" if x is None or x != x else format(x, spec)


def batch_rows_table(results: list[BatchResult]) -> str:
    lines = [
        "| batch size | method | tree (d,k,n) | adaptive | τ | draft tok/step | tok/s (whole run) "
        "| speedup vs vanilla (same bs) | tok/s at full batch | speedup at full batch | decode-only tok/s "
        "| mean running batch | fallbacks | peak RSS (MB, process) | RSS rise in row (MB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ad = "yes" if r.adaptive else "no"
        if r.error:
            lines.append(f"| {r.batch_size} | {r.method} | {r.tree} | {ad} | failed: {r.error} | | | | | | | | | | |")
            continue
        s, sf = speedup(r, results), speedup(r, results, steady=True)
        spec = r.method != "vanilla"
        lines.append(
            f"| {r.batch_size} | {r.method} | {r.tree} | {ad} | {fmt(r.tau) if spec else '-'} "
            f"| {fmt(r.draft_per_step, '.1f') if spec else '-'} "
            f"| {fmt(r.tokens_per_s, '.1f')} | {fmt(s) + '×' if s is not None else 'n/a'} "
            f"| {fmt(r.full_tokens_per_s, '.1f')} | {fmt(sf) + '×' if sf is not None else 'n/a'} "
            f"| {fmt(r.decode_tokens_per_s, '.1f')} | {fmt(r.mean_batch, '.1f')} | {r.fallbacks} "
            f"| {fmt(r.peak_rss_mb, '.0f')} | {fmt(r.rss_rise_mb, '.0f')} |"
        )
    return "\n".join(lines)


def batch_grid_table(results: list[BatchResult], steady: bool = False) -> str:
    """Rows = method, columns = batch sizes, cells = tok/s (×vanilla at that batch size); steady: the
    rates at full batch."""
    sizes = sorted({r.batch_size for r in results})
    keys = list(dict.fromkeys(r.key for r in results))
    lines = ["| method | " + " | ".join(f"bs={b}" for b in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for k in keys:
        cells = []
        for b in sizes:
            r = next((x for x in results if x.key == k and x.batch_size == b), None)
            if r is None:
                cells.append("")
            elif r.error:
                cells.append("failed")
            else:
                s, rate = speedup(r, results, steady), r.full_tokens_per_s if steady else r.tokens_per_s
                cells.append(f"{rate:.1f} ({fmt(s)}×)" if s is not None else f"{rate:.1f}")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def batch_json(results: list[BatchResult]) -> list[dict]:
    from dataclasses import asdict

    return [
        {
            **asdict(r),
            "tau": r.tau,
            "tokens_per_s": r.tokens_per_s,
            "draft_per_step": r.draft_per_step,
            "decode_tokens_per_s": r.decode_tokens_per_s,
            "mean_batch": r.mean_batch,
            "speedup_vs_vanilla": speedup(r, results),
            "full_tokens_per_s": r.full_tokens_per_s,
            "speedup_at_full_batch": speedup(r, results, steady=True),
            "acceptance_by_position": r.acceptance_by_position,
        }
        for r in results
    ]


def plot_throughput(results: list[BatchResult], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k in dict.fromkeys(r.key for r in results):
        pts = sorted((r.batch_size, r.tokens_per_s) for r in results if r.key == k and not r.error and r.runs)
        if pts:
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                linestyle="--" if k.startswith("vanilla") else "-",
                label=k,
            )
    ax.set_xscale("log", base=2)
    sizes = sorted({r.batch_size for r in results})
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlabel("batch size (requests running at a time)")
    ax.set_ylabel("generated tokens/s (whole run)")
    ax.set_title("Throughput vs batch size, with and without speculation")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
