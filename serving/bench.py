"""`moa-serve bench`: vanilla vs each drafter (and peers) on the same prompts, in one run.

Every speed figure is a ratio to the vanilla row measured in the same run (machines are noisy).
tau = mean (accepted + 1) per verify step, pooled over all verify steps of a method.
Acceptance by draft position i = the fraction of a method's verify steps whose draft token at depth i
was accepted (so it falls with i; position 1 is the chance the first draft token is right).
Peers (transformers, llama.cpp) run interleaved with our methods: serving/peers.py.
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
    from sglang_ext.drafters.suffix import SuffixDrafter

    drafter = make_drafter("none" if method == "vanilla" else method, target)
    if isinstance(drafter, SuffixDrafter):
        drafter.online = False
    return drafter


def engine_runner(target, method: str, tree, sp):
    """A function prompt -> (output ids, stats) running our engine with one drafter (or none); sp: SamplingParams."""
    from .engine import Engine

    engine = Engine(target, bench_drafter(method, target), tree)

    def run(prompt):
        r = engine.generate([prompt], sp)[0]
        return r.output_ids, r.stats

    return run


def add_runner(runners: dict, res: MethodResult, make) -> None:
    """Build a method's runner; one that cannot be built is kept as a row with the reason (a peer that
    is not available here: "skipped: why"), never dropped."""
    from .peers import PeerUnavailable

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


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmark vanilla vs drafters (and peers) in one run")
    b.add_argument("--model", default="smollm2")
    b.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    b.add_argument(
        "--eval-sets",
        default="mt_bench",
        help="comma list of mt_bench,humaneval,gsm8k,alpaca,sum,qa, builtin, or .jsonl paths",
    )
    b.add_argument(
        "--methods",
        default="vanilla,ngram,draft-model",
        help="semicolon list of drafters, each optionally with a tree (ngram:4,2,8); vanilla is always run first",
    )
    b.add_argument(
        "--peers",
        default=None,
        help=(
            "comma list of peers (hf-generate,hf-assisted,hf-prompt-lookup,llama.cpp,llama.cpp-prompt-lookup), 'all' "
            "or 'none' (default: all; hf-generate with --quick); a peer that cannot run here is reported as skipped"
        ),
    )
    b.add_argument(
        "--peer-lookup-tokens",
        type=int,
        default=10,
        help=(
            "prompt-lookup peers (hf-prompt-lookup, llama.cpp-prompt-lookup): draft tokens per lookup (both "
            "libraries' usual 10)"
        ),
    )
    b.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 = greedy; > 0: every method, peer and the batch sweep sample with it (seeded)",
    )
    b.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling with --temperature > 0")
    b.add_argument(
        "--seed",
        type=int,
        default=0,
        help=(
            "sampling seed, the same for every prompt and method (seeded requests verify by coupled sampling: the "
            "same text for every method; -1: unseeded, SpecInfer rejection sampling)"
        ),
    )
    b.add_argument("--num-prompts", type=int, default=10)
    b.add_argument("--max-new-tokens", type=int, default=None, help="default 128 (16 with --quick)")
    b.add_argument("--tree", default=None, help="depth,topk,num_draft_tokens for every drafter (default: per-drafter)")
    b.add_argument("--out", default="results/bench", help="directory for results.json and table.md")
    b.add_argument("--report", default=None, help="also write a markdown report here (e.g. docs/BENCHMARKS.md)")
    b.add_argument(
        "--quick",
        action="store_true",
        help="smoke mode: 2 prompts, 16 tokens (sweep: 1 repeat; gateway overhead: 3 requests)",
    )
    b.add_argument(
        "--batch-sizes",
        default=None,
        help=(
            "batch sweep, e.g. 1,2,4,8,16,32,64: per batch size b, each method serves a queue of "
            "max(--sweep-min-prompts, 2b) prompts with b running at a time (continuous batching), methods interleaved "
            "step by step (default: no sweep; the per-prompt table above is batch size 1)"
        ),
    )
    b.add_argument(
        "--adaptive",
        action="store_true",
        help=(
            "sweep and gateway overhead: drafter rows use Engine(adaptive=True) (per-step tree / off from measured "
            "throughput, the serving default)"
        ),
    )
    b.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="sweep: measured runs per (batch size, method), method order rotated each repeat",
    )
    b.add_argument(
        "--sweep-min-prompts",
        type=int,
        default=24,
        help=(
            "sweep: a measured run at batch size b serves max(this, 2b) prompts, b at a time (continuous batching); "
            "at small b more than 2b, so the start and the drain tail are a small part of the run"
        ),
    )
    b.add_argument(
        "--sweep-only",
        action="store_true",
        help="skip the per-prompt (bs=1, peers) table; run only --batch-sizes / --gateway-overhead",
    )
    b.add_argument(
        "--gateway-overhead",
        action="store_true",
        help="p50 latency of one short greedy request: Engine directly vs the real gateway over HTTP on 127.0.0.1",
    )
    b.add_argument("--overhead-requests", type=int, default=20, help="gateway overhead: measured requests per path")
    b.add_argument(
        "--overhead-tokens",
        type=int,
        default=32,
        help="gateway overhead: new tokens per request (ignore_eos, so every request has this length)",
    )
    b.add_argument(
        "--overhead-method",
        default=None,
        help="gateway overhead: the drafter (default: the first of --methods; 'vanilla' for none)",
    )


def cmd_bench(args) -> int:
    from sglang_ext.drafters.draft_model import default_self_draft_layers
    from sglang_ext.models import load_target, parse_dtype
    from sglang_ext.sampling import SamplingParams
    from sglang_ext.tree import TreeShape

    from . import peers as peer_lib
    from .cli import default_tree
    from .evalsets import load_eval_set

    if args.quick:
        args.num_prompts, args.max_new_tokens = 2, args.max_new_tokens or 16
        args.repeats, args.overhead_requests, args.overhead_tokens = 1, 3, 4
    args.max_new_tokens = args.max_new_tokens or 128
    methods = (
        [m for m in args.methods.replace(",", ";").split(";") if m and m != "vanilla"]
        if ":" not in args.methods
        else [m for m in args.methods.split(";") if m and m != "vanilla"]
    )
    if args.peers is None:
        args.peers = "hf-generate" if args.quick else "all"
    peers = list(
        dict.fromkeys(
            q for p in args.peers.split(",") if p and p != "none" for q in (peer_lib.PEERS if p == "all" else [p])
        )
    )
    sp = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=None if args.seed < 0 else args.seed,
    )
    sampling = peer_lib.sampling_label(sp)
    target = load_target(args.model, dtype=args.dtype)
    eos_ids = sorted(
        set(target.cfg.eos_token_ids)
        | ({target.tokenizer.eos_token_id} if getattr(target.tokenizer, "eos_token_id", None) is not None else set())
    )
    hf_cache: dict = {}  # one transformers copy of the target, shared by the HF peers and eval sets
    assistant_layers = default_self_draft_layers(target.cfg.num_layers)
    results: list[MethodResult] = []
    runners: dict[str, tuple[MethodResult, object]] = {}
    sweep_prompts: list[list[list[int]]] = []  # per eval set, for the batch sweep
    for set_name in args.eval_sets.split(","):
        name, texts = load_eval_set(set_name, args.num_prompts)
        prompts = [target.encode_chat([{"role": "user", "content": t}]) for t in texts]
        sweep_prompts.append(prompts)
        if args.sweep_only:
            continue
        runners = {}

        def add(label, tree_text, make, runners=runners, name=name):
            add_runner(runners, MethodResult(label, name, tree_text), make)

        add("vanilla", "-", lambda: engine_runner(target, "vanilla", TreeShape.chain(1), sp))
        for spec in methods:
            m, _, tree_text = spec.partition(":")  # "ngram:4,2,8" = drafter with an explicit tree
            tree = TreeShape.parse(tree_text or args.tree) if (tree_text or args.tree) else default_tree(m)
            add(m, tree.label, lambda m=m, tree=tree: engine_runner(target, m, tree, sp))

        def hf():
            return peer_lib.load_hf_model(target, parse_dtype(args.dtype), hf_cache)

        def assistant():
            if "assistant" not in hf_cache:
                hf_cache["assistant"] = peer_lib.hf_self_draft_assistant(hf(), assistant_layers)
            return hf_cache["assistant"]

        n_ctx = max(map(len, prompts)) + args.max_new_tokens + args.peer_lookup_tokens + 16
        lookup = args.peer_lookup_tokens
        layers_text = peer_lib.layer_ranges(assistant_layers)
        for p in peers:
            if p == "hf-generate":
                add(p, "-", lambda: peer_lib.hf_runner(hf(), sp, eos_ids))
            elif p == "hf-assisted":  # HF's own draft-length schedule (its defaults), our self-draft as the model
                add(
                    p,
                    f"assistant: layers {layers_text}",
                    lambda: peer_lib.hf_runner(hf(), sp, eos_ids, assistant_model=assistant()),
                )
            elif p == "hf-prompt-lookup":
                add(
                    p,
                    f"lookup {lookup}",
                    lambda lookup=lookup: peer_lib.hf_runner(hf(), sp, eos_ids, prompt_lookup_num_tokens=lookup),
                )
            elif p in ("llama.cpp", "llama.cpp-prompt-lookup"):
                add(
                    p,
                    f"lookup {lookup}" if p.endswith("lookup") else "-",
                    lambda p=p, n_ctx=n_ctx, lookup=lookup: peer_lib.llama_cpp_runner(
                        peer_lib.target_gguf(args.model),
                        sp,
                        eos_ids,
                        n_ctx,
                        torch.get_num_threads(),
                        lookup if p.endswith("lookup") else None,
                    ),
                )
            else:
                add(
                    p,
                    "-",
                    lambda p=p: (_ for _ in ()).throw(
                        ValueError(f"unknown peer {p!r}; choose from {', '.join(peer_lib.PEERS)}")
                    ),
                )
        run_interleaved({k: v for k, v in runners.items() if v[1] is not None}, prompts)
        vanilla = runners["vanilla -"][0]
        for res, _ in runners.values():
            res.identical = sum(a == b for a, b in zip(res.outputs, vanilla.outputs))
            results.append(res)
            print(
                f"{name} {res.method} {res.tree}: tau {res.tau:.2f} {res.tokens_per_s:.1f} tok/s {res.error or ''}",
                file=sys.stderr,
            )
    runners.clear()  # peers (a transformers copy, llama.cpp) are not part of the batch sweep: free them
    hf_cache.clear()

    def tree_for(m):
        return TreeShape.parse(args.tree) if args.tree else default_tree(m)

    sweep, overhead = [], []
    if args.batch_sizes:
        from .bench_batch import engine_batch_runner, run_batch_sweep

        sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
        if not sizes or min(sizes) < 1:
            raise ValueError(f"--batch-sizes must be positive integers, got {args.batch_sizes!r}")
        mixed = [
            p for group in itertools.zip_longest(*sweep_prompts) for p in group if p is not None
        ]  # round-robin over eval sets
        cache: dict = {}
        entries = [
            (
                "vanilla",
                "-",
                False,
                lambda: engine_batch_runner(
                    target, "vanilla", TreeShape.chain(1), args.max_new_tokens, False, cache, sp
                ),
            )
        ]
        for spec in methods:
            m, _, tree_text = spec.partition(":")
            tree = TreeShape.parse(tree_text) if tree_text else tree_for(m)
            entries.append(
                (
                    m,
                    tree.label,
                    args.adaptive,
                    lambda m=m, tree=tree: engine_batch_runner(
                        target, m, tree, args.max_new_tokens, args.adaptive, cache, sp
                    ),
                )
            )
        sweep = run_batch_sweep(
            entries,
            mixed,
            sizes,
            repeats=args.repeats,
            warmup_tokens=4 if args.quick else 16,
            log=lambda s: print(s, file=sys.stderr),
            min_prompts=1 if args.quick else args.sweep_min_prompts,
        )
    if args.gateway_overhead:
        from .bench_batch import measure_gateway_overhead

        om = args.overhead_method or (methods[0].partition(":")[0] if methods else "vanilla")
        ospec = next((s for s in methods if s.partition(":")[0] == om), om)
        otree = (
            TreeShape.parse(ospec.partition(":")[2])
            if ospec.partition(":")[2]
            else (tree_for(om) if om != "vanilla" else TreeShape.chain(1))
        )
        msgs = [{"role": "user", "content": "Explain in two sentences what a hash table is."}]
        overhead = [
            measure_gateway_overhead(
                target,
                om,
                otree,
                args.adaptive,
                msgs,
                args.overhead_tokens,
                args.overhead_requests,
                warmup=1 if args.quick else 5,
            )
        ]
    command = (
        "moa-serve " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        if sys.argv[0].endswith("moa-serve")
        else "moa-serve bench ..."
    )
    table = markdown_table(results, sampling=not sp.greedy) if results else ""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": command,
        "machine": machine_description(),
        "dtype": str(target.model.dtype).removeprefix("torch."),
        "max_new_tokens": args.max_new_tokens,
        "sampling": {"temperature": sp.temperature, "top_p": sp.top_p, "seed": sp.seed, "label": sampling},
        "results": [
            {
                **{k: v for k, v in asdict(r).items() if k != "outputs"},
                "tau": r.tau,
                "tokens_per_s": r.tokens_per_s,
                "draft_per_step": r.draft_per_step,
                "acceptance_by_position": r.acceptance_by_position,
                "skipped": bool(r.error and r.error.startswith("skipped:")),
            }
            for r in results
        ],
    }
    sections = [table] if table else []
    if accept := acceptance_table(results):
        payload["acceptance_by_position"] = pooled_acceptance(results)
        plot = ""
        try:
            plot_tau_by_set(results, out / "tau_by_eval_set.png")
            if plot_acceptance(results, out / "acceptance_by_position.png"):
                plot = "\n\n![acceptance by draft position](acceptance_by_position.png)"
        except Exception as e:  # noqa: BLE001 - the numbers are still written
            print(f"plot failed: {type(e).__name__}: {e}", file=sys.stderr)
        sections.append(
            "### Acceptance rate by draft position (fraction of verify steps that accepted draft position i; "
            f"{sampling})\n\n{accept}{plot}"
        )
    if sweep:
        from .bench_batch import batch_grid_table, batch_json, batch_rows_table, plot_throughput

        payload["batch_sweep"] = {
            "batch_sizes": sizes,
            "adaptive": args.adaptive,
            "repeats": args.repeats,
            "min_prompts": args.sweep_min_prompts,
            "eval_sets": args.eval_sets.split(","),
            "distinct_prompts": len(mixed),
            "memory": (
                "peak process RSS (psutil, sampled every 5 ms) during the row's measured run(s) "
                "(all engines alive at that batch size included), and its rise over the RSS when the run started"
            ),
            "rows": batch_json(sweep),
        }
        sections.append(
            f"## Throughput vs batch size ({args.max_new_tokens} new tokens, {sampling}, {args.repeats} repeat(s); at "
            f"batch size b, max({args.sweep_min_prompts}, 2b) prompts served b at a time with continuous "
            f"batching)\n\n{batch_rows_table(sweep)}\n\n"
            f"### tok/s (× vanilla at the same batch size), whole run\n\n{batch_grid_table(sweep)}\n\n"
            "### tok/s (× vanilla at the same batch size) at full batch: steps with b requests in the engine (steady "
            f"load of b clients; the drain tail excluded)\n\n{batch_grid_table(sweep, steady=True)}\n\n"
            "![throughput vs batch size](throughput_vs_batch.png)"
        )
        try:
            plot_throughput(sweep, out / "throughput_vs_batch.png")
        except Exception as e:  # noqa: BLE001 - the numbers are still written
            print(f"plot failed: {type(e).__name__}: {e}", file=sys.stderr)
    if overhead:
        from .bench_batch import overhead_json, overhead_table

        payload["gateway_overhead"] = overhead_json(overhead)
        sections.append(
            f"## Gateway overhead (one greedy chat request at a time, 127.0.0.1)\n\n{overhead_table(overhead)}"
        )
    table = "\n\n".join(sections)
    (out / "results.json").write_text(json.dumps(payload, indent=2))
    (out / "table.md").write_text(table + "\n")
    print(table)
    if args.report:
        import os

        for png in ("throughput_vs_batch.png", "acceptance_by_position.png"):
            table = table.replace(f"]({png})", f"]({os.path.relpath(out / png, Path(args.report).resolve().parent)})")
        Path(args.report).write_text(
            f"# Benchmarks\n\nCommand: `{command}`\n\n"
            f"Machine: {payload['machine']}; dtype {payload['dtype']}; {sampling}; {args.max_new_tokens} new tokens; "
            f"per-prompt table at batch size 1{'; batch sweep ' + args.batch_sizes if sweep else ''}.\n\n{table}\n"
        )
    return 0
