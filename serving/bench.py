"""`moa-serve bench`: vanilla vs each drafter (and peers) on the same prompts, in one run.

Every speed figure is a ratio to the vanilla row measured in the same run (machines are noisy).
tau = mean (accepted + 1) per verify step, pooled over all verify steps of a method.
"""

from __future__ import annotations

import itertools
import json
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch


class SpecRates:
    """Rates every benchmark row derives from its counters (tokens, seconds, verify_steps, accepted, drafted)."""

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
    error: str | None = None
    outputs: list[list[int]] = field(default_factory=list, repr=False)


def engine_runner(target, method: str, tree, max_new_tokens: int):
    """A function prompt -> (output ids, stats) running our engine with one drafter (or none)."""
    from sglang_ext.drafters import make_drafter
    from sglang_ext.sampling import SamplingParams

    from .engine import Engine

    engine = Engine(target, make_drafter("none" if method == "vanilla" else method, target), tree)
    sp = SamplingParams(max_new_tokens=max_new_tokens)

    def run(prompt):
        r = engine.generate([prompt], sp)[0]
        return r.output_ids, r.stats

    return run


def hf_generate_runner(target, max_new_tokens: int, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target.path, dtype=dtype).eval()
    eos = list(target.cfg.eos_token_ids)

    def run(prompt):
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
        return out[0, len(prompt) :].tolist(), None

    return run


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


def markdown_table(results: list[MethodResult]) -> str:
    lines = [
        "| eval set | method | tree (d,k,n) | τ | draft tok/step | tok/s | speedup vs vanilla | same as vanilla |",
        "|---|---|---|---|---|---|---|---|",
    ]
    vanilla = {r.eval_set: r for r in results if r.method == "vanilla" and not r.error}
    for r in results:
        if r.error:
            lines.append(f"| {r.eval_set} | {r.method} | {r.tree} | failed: {r.error} | | | | |")
            continue
        v = vanilla.get(r.eval_set)
        speed = f"{r.tokens_per_s / v.tokens_per_s:.2f}×" if v else "n/a"
        same = f"{r.identical}/{r.prompts}" if v and r.method != "vanilla" else "-"
        tau = f"{r.tau:.2f}" if r.verify_steps else "-"
        dps = f"{r.draft_per_step:.1f}" if r.verify_steps else "-"
        lines.append(f"| {r.eval_set} | {r.method} | {r.tree} | {tau} | {dps} | {r.tokens_per_s:.1f} | {speed} | {same} |")
    return "\n".join(lines)


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
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads, Python {platform.python_version()}, no GPU"


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmark vanilla vs drafters (and peers) in one run")
    b.add_argument("--model", default="smollm2")
    b.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    b.add_argument("--eval-sets", default="mt_bench", help="comma list of mt_bench,humaneval,gsm8k,alpaca,sum,qa, builtin, or .jsonl paths")
    b.add_argument("--methods", default="vanilla,ngram,draft-model", help="semicolon list of drafters, each optionally with a tree (ngram:4,2,8); vanilla is always run first")
    b.add_argument("--peers", default="hf-generate", help="comma list of peers (hf-generate) or 'none'")
    b.add_argument("--num-prompts", type=int, default=10)
    b.add_argument("--max-new-tokens", type=int, default=None, help="default 128 (16 with --quick)")
    b.add_argument("--tree", default=None, help="depth,topk,num_draft_tokens for every drafter (default: per-drafter)")
    b.add_argument("--out", default="results/bench", help="directory for results.json and table.md")
    b.add_argument("--report", default=None, help="also write a markdown report here (e.g. docs/BENCHMARKS.md)")
    b.add_argument("--quick", action="store_true", help="smoke mode: 2 prompts, 16 tokens (sweep: 1 repeat; gateway overhead: 3 requests)")
    b.add_argument("--batch-sizes", default=None, help="batch sweep, e.g. 1,2,4,8,16,32,64: per batch size, each method runs that many prompts as one continuous batch (default: no sweep; the per-prompt table above is batch size 1)")
    b.add_argument("--adaptive", action="store_true", help="sweep and gateway overhead: drafter rows use Engine(adaptive=True) (per-step tree / off from measured throughput, the serving default)")
    b.add_argument("--repeats", type=int, default=1, help="sweep: measured runs per (batch size, method), method order rotated each repeat")
    b.add_argument("--sweep-only", action="store_true", help="skip the per-prompt (bs=1, peers) table; run only --batch-sizes / --gateway-overhead")
    b.add_argument("--gateway-overhead", action="store_true", help="p50 latency of one short greedy request: Engine directly vs the real gateway over HTTP on 127.0.0.1")
    b.add_argument("--overhead-requests", type=int, default=20, help="gateway overhead: measured requests per path")
    b.add_argument("--overhead-tokens", type=int, default=32, help="gateway overhead: new tokens per request (ignore_eos, so every request has this length)")
    b.add_argument("--overhead-method", default=None, help="gateway overhead: the drafter (default: the first of --methods; 'vanilla' for none)")


def cmd_bench(args) -> int:
    from sglang_ext.models import load_target, parse_dtype
    from sglang_ext.tree import TreeShape

    from .cli import default_tree
    from .evalsets import load_eval_set

    if args.quick:
        args.num_prompts, args.max_new_tokens = 2, args.max_new_tokens or 16
        args.repeats, args.overhead_requests, args.overhead_tokens = 1, 3, 4
    args.max_new_tokens = args.max_new_tokens or 128
    methods = [m for m in args.methods.replace(",", ";").split(";") if m and m != "vanilla"] if ":" not in args.methods else [m for m in args.methods.split(";") if m and m != "vanilla"]
    peers = [p for p in args.peers.split(",") if p and p != "none"]
    target = load_target(args.model, dtype=args.dtype)
    results: list[MethodResult] = []
    sweep_prompts: list[list[list[int]]] = []  # per eval set, for the batch sweep
    for set_name in args.eval_sets.split(","):
        name, texts = load_eval_set(set_name, args.num_prompts)
        prompts = [target.encode_chat([{"role": "user", "content": t}]) for t in texts]
        sweep_prompts.append(prompts)
        if args.sweep_only:
            continue
        runners: dict[str, tuple[MethodResult, object]] = {}

        def add(label, tree_text, make):
            res = MethodResult(label, name, tree_text)
            try:
                runners[f"{label} {tree_text}"] = (res, make())
            except Exception as e:  # noqa: BLE001 - e.g. an unknown drafter: reported in the table
                res.error = f"{type(e).__name__}: {e}"
                runners[f"{label} {tree_text}"] = (res, None)

        add("vanilla", "-", lambda: engine_runner(target, "vanilla", TreeShape.chain(1), args.max_new_tokens))
        for spec in methods:
            m, _, tree_text = spec.partition(":")  # "ngram:4,2,8" = drafter with an explicit tree
            tree = TreeShape.parse(tree_text or args.tree) if (tree_text or args.tree) else default_tree(m)
            add(m, f"{tree.depth},{tree.topk},{tree.num_draft_tokens}", lambda m=m, tree=tree: engine_runner(target, m, tree, args.max_new_tokens))
        for p in peers:
            if p == "hf-generate":
                add(p, "-", lambda: hf_generate_runner(target, args.max_new_tokens, parse_dtype(args.dtype)))
            else:
                add(p, "-", lambda p=p: (_ for _ in ()).throw(ValueError(f"unknown peer {p!r}")))
        run_interleaved({k: v for k, v in runners.items() if v[1] is not None}, prompts)
        vanilla = runners["vanilla -"][0]
        for res, _ in runners.values():
            res.identical = sum(a == b for a, b in zip(res.outputs, vanilla.outputs))
            results.append(res)
            print(f"{name} {res.method} {res.tree}: tau {res.tau:.2f} {res.tokens_per_s:.1f} tok/s {res.error or ''}", file=sys.stderr)

    def tree_for(m):
        return TreeShape.parse(args.tree) if args.tree else default_tree(m)

    sweep, overhead = [], []
    if args.batch_sizes:
        from .bench_batch import engine_batch_runner, run_batch_sweep

        sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
        if not sizes or min(sizes) < 1:
            raise ValueError(f"--batch-sizes must be positive integers, got {args.batch_sizes!r}")
        mixed = [p for group in itertools.zip_longest(*sweep_prompts) for p in group if p is not None]  # round-robin over eval sets
        cache: dict = {}
        entries = [("vanilla", "-", False, lambda: engine_batch_runner(target, "vanilla", TreeShape.chain(1), args.max_new_tokens, False, cache))]
        for spec in methods:
            m, _, tree_text = spec.partition(":")
            tree = TreeShape.parse(tree_text) if tree_text else tree_for(m)
            entries.append((m, f"{tree.depth},{tree.topk},{tree.num_draft_tokens}", args.adaptive, lambda m=m, tree=tree: engine_batch_runner(target, m, tree, args.max_new_tokens, args.adaptive, cache)))
        sweep = run_batch_sweep(entries, mixed, sizes, repeats=args.repeats, warmup_tokens=4 if args.quick else 16, log=lambda s: print(s, file=sys.stderr))
    if args.gateway_overhead:
        from .bench_batch import measure_gateway_overhead

        om = args.overhead_method or (methods[0].partition(":")[0] if methods else "vanilla")
        ospec = next((s for s in methods if s.partition(":")[0] == om), om)
        otree = TreeShape.parse(ospec.partition(":")[2]) if ospec.partition(":")[2] else (tree_for(om) if om != "vanilla" else TreeShape.chain(1))
        msgs = [{"role": "user", "content": "Explain in two sentences what a hash table is."}]
        overhead = [measure_gateway_overhead(target, om, otree, args.adaptive, msgs, args.overhead_tokens, args.overhead_requests, warmup=1 if args.quick else 5)]
    command = "moa-serve " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[0].endswith("moa-serve") else "moa-serve bench ..."
    table = markdown_table(results) if results else ""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": command,
        "machine": machine_description(),
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "results": [{**{k: v for k, v in asdict(r).items() if k != "outputs"}, "tau": r.tau, "tokens_per_s": r.tokens_per_s, "draft_per_step": r.draft_per_step} for r in results],
    }
    sections = [table] if table else []
    if sweep:
        from .bench_batch import batch_grid_table, batch_json, batch_rows_table, plot_throughput

        payload["batch_sweep"] = {"batch_sizes": sizes, "adaptive": args.adaptive, "repeats": args.repeats, "eval_sets": args.eval_sets.split(","), "distinct_prompts": len(mixed),
                                  "memory": "peak process RSS (psutil, sampled every 5 ms) during the row's measured run(s) (all engines alive at that batch size included), and its rise over the RSS when the run started",
                                  "rows": batch_json(sweep)}
        sections.append(f"## Throughput vs batch size ({args.max_new_tokens} new tokens, greedy, {args.repeats} repeat(s))\n\n{batch_rows_table(sweep)}\n\n"
                        f"### tok/s (× vanilla at the same batch size)\n\n{batch_grid_table(sweep)}\n\n![throughput vs batch size](throughput_vs_batch.png)")
        try:
            plot_throughput(sweep, out / "throughput_vs_batch.png")
        except Exception as e:  # noqa: BLE001 - the numbers are still written
            print(f"plot failed: {type(e).__name__}: {e}", file=sys.stderr)
    if overhead:
        from .bench_batch import overhead_json, overhead_table

        payload["gateway_overhead"] = overhead_json(overhead)
        sections.append(f"## Gateway overhead (one greedy chat request at a time, 127.0.0.1)\n\n{overhead_table(overhead)}")
    table = "\n\n".join(sections)
    (out / "results.json").write_text(json.dumps(payload, indent=2))
    (out / "table.md").write_text(table + "\n")
    print(table)
    if args.report:
        import os

        table = table.replace("](throughput_vs_batch.png)", f"]({os.path.relpath(out / 'throughput_vs_batch.png', Path(args.report).resolve().parent)})")
        Path(args.report).write_text(f"# Benchmarks\n\nCommand: `{command}`\n\nMachine: {payload['machine']}; dtype {args.dtype}; greedy; {args.max_new_tokens} new tokens; per-prompt table at batch size 1{'; batch sweep ' + args.batch_sizes if sweep else ''}.\n\n{table}\n")
    return 0
