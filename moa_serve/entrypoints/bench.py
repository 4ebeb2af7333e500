"""`moa-serve bench`: vanilla vs each drafter (and peers) on the same prompts, in one run
(moa_serve/benchmarks/bench.py, moa_serve/benchmarks/batch.py)."""

from __future__ import annotations

import itertools
import json
import os
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from moa_serve.benchmarks.bench import (
    MethodResult,
    acceptance_table,
    add_runner,
    engine_runner,
    machine_description,
    markdown_table,
    plot_acceptance,
    plot_tau_by_set,
    pooled_acceptance,
    run_interleaved,
)
from moa_serve.entrypoints.flags import add_model_args


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmark vanilla vs drafters (and peers) in one run")
    add_model_args(b)
    _add_method_args(b)
    _add_sampling_args(b)
    b.add_argument("--out", default="results/bench", help="directory for results.json and table.md")
    b.add_argument("--report", default=None, help="also write a markdown report here (e.g. docs/BENCHMARKS.md)")
    b.add_argument(
        "--quick",
        action="store_true",
        help="smoke mode: 2 prompts, 16 tokens (sweep: 1 repeat; gateway overhead: 3 requests)",
    )
    _add_sweep_args(b)
    _add_overhead_args(b)


def _add_method_args(b) -> None:
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
    b.add_argument("--tree", default=None, help="depth,topk,num_draft_tokens for every drafter (default: per-drafter)")


def _add_sampling_args(b) -> None:
    """bench's own sampling flags: one seeded setting for every method and peer (not generate's flags:
    penalties and structured output are not benchmarked, and --seed -1 means unseeded)."""
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


def _add_sweep_args(b) -> None:
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
            "sweep and gateway overhead: drafter rows use EngineConfig(adaptive=True) (per-step tree / off from "
            "measured throughput, the serving default)"
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


def _add_overhead_args(b) -> None:
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


def _method_tree(spec: str, tree: str | None):
    """'ngram:4,2,8' -> ('ngram', that tree); without one, --tree, else the drafter's default tree."""
    from sglang_ext.drafters import default_tree
    from sglang_ext.tree import TreeShape

    m, _, text = spec.partition(":")
    text = text or tree
    return m, TreeShape.parse(text) if text else default_tree(m)


def _methods(args) -> list[str]:
    """--methods as drafter specs, vanilla left out (it always runs first)."""
    if ":" not in args.methods:
        return [m for m in args.methods.replace(",", ";").split(";") if m and m != "vanilla"]
    return [m for m in args.methods.split(";") if m and m != "vanilla"]


def _peers(args) -> list[str]:
    from moa_serve.benchmarks import peers as peer_lib

    spec = args.peers if args.peers is not None else "hf-generate" if args.quick else "all"
    return list(
        dict.fromkeys(q for p in spec.split(",") if p and p != "none" for q in (peer_lib.PEERS if p == "all" else [p]))
    )


def _batch_sizes(text: str | None) -> list[int]:
    if not text:
        return []
    sizes = [int(x) for x in text.split(",") if x.strip()]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-sizes must be positive integers, got {text!r}")
    return sizes


def cmd_bench(args) -> int:
    from sglang_ext.models import load_target
    from sglang_ext.sampling import SamplingParams

    if args.quick:
        args.num_prompts, args.max_new_tokens = 2, args.max_new_tokens or 16
        args.repeats, args.overhead_requests, args.overhead_tokens = 1, 3, 4
    args.max_new_tokens = args.max_new_tokens or 128
    methods, peers, sizes = _methods(args), _peers(args), _batch_sizes(args.batch_sizes)
    sp = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=None if args.seed < 0 else args.seed,
    )
    target = load_target(args.model, dtype=args.dtype, device=args.device)
    prompts_by_set, results = _per_prompt_rows(args, target, methods, peers, sp)
    mixed = [p for group in itertools.zip_longest(*prompts_by_set) for p in group if p is not None]  # round-robin
    sweep = _batch_sweep(args, target, methods, sp, sizes, mixed) if sizes else []
    overhead = [_gateway_overhead(args, target, methods)] if args.gateway_overhead else []
    _write_results(args, target, sp, results, sweep, overhead, sizes, len(mixed))
    return 0


def _per_prompt_rows(args, target, methods: list[str], peers: list[str], sp):
    """The per-prompt table (bs 1, peers): -> (the prompts of each eval set, the rows)."""
    from sglang_ext.evalsets import load_eval_set
    from sglang_ext.tree import TreeShape

    prompts_by_set: list[list[list[int]]] = []
    results: list[MethodResult] = []
    hf_cache: dict = {}  # one transformers copy of the target, shared by the HF peers and eval sets
    for set_name in args.eval_sets.split(","):
        name, texts = load_eval_set(set_name, args.num_prompts)
        prompts = [target.encode_chat([{"role": "user", "content": t}]) for t in texts]
        prompts_by_set.append(prompts)
        if args.sweep_only:
            continue
        runners: dict[str, tuple[MethodResult, object]] = {}

        def add(label, tree_text, make, runners=runners, name=name):
            add_runner(runners, MethodResult(label, name, tree_text), make)

        add("vanilla", "-", lambda: engine_runner(target, "vanilla", TreeShape.chain(1), sp))
        for spec in methods:
            m, tree = _method_tree(spec, args.tree)
            add(m, tree.label, lambda m=m, tree=tree: engine_runner(target, m, tree, sp))
        _add_peers(add, peers, args, target, sp, prompts, hf_cache)
        results += _run_set(runners, prompts, name)
    hf_cache.clear()  # peers (a transformers copy, llama.cpp) are not part of the batch sweep: free them
    return prompts_by_set, results


def _add_peers(add, peers: list[str], args, target, sp, prompts: list[list[int]], hf_cache: dict) -> None:
    """add(label, tree text, make_runner) for each peer (moa_serve/benchmarks/peers.py)."""
    from moa_serve.benchmarks import peers as peer_lib
    from sglang_ext.drafters.draft_model import default_self_draft_layers

    eos = getattr(target.tokenizer, "eos_token_id", None)
    eos_ids = sorted(set(target.cfg.eos_token_ids) | ({eos} if eos is not None else set()))
    assistant_layers = default_self_draft_layers(target.cfg.num_layers)

    def hf():
        # the target's own dtype and device: transformers runs on the same chip as our engine
        return peer_lib.load_hf_model(target, target.model.dtype, hf_cache, target.model.device)

    def assistant():
        if "assistant" not in hf_cache:
            hf_cache["assistant"] = peer_lib.hf_self_draft_assistant(hf(), assistant_layers)
        return hf_cache["assistant"]

    lookup = args.peer_lookup_tokens
    n_ctx = max(map(len, prompts)) + args.max_new_tokens + lookup + 16
    for p in peers:
        if p == "hf-generate":
            add(p, "-", lambda: peer_lib.hf_runner(hf(), sp, eos_ids))
        elif p == "hf-assisted":  # HF's own draft-length schedule (its defaults), our self-draft as the model
            add(
                p,
                f"assistant: layers {peer_lib.layer_ranges(assistant_layers)}",
                lambda: peer_lib.hf_runner(hf(), sp, eos_ids, assistant_model=assistant()),
            )
        elif p == "hf-prompt-lookup":
            add(p, f"lookup {lookup}", lambda: peer_lib.hf_runner(hf(), sp, eos_ids, prompt_lookup_num_tokens=lookup))
        elif p in ("llama.cpp", "llama.cpp-prompt-lookup"):
            n = lookup if p.endswith("lookup") else None
            add(
                p,
                f"lookup {lookup}" if n else "-",
                lambda n=n: peer_lib.llama_cpp_runner(
                    peer_lib.target_gguf(args.model), sp, eos_ids, n_ctx, torch.get_num_threads(), n
                ),
            )
        else:
            error = ValueError(f"unknown peer {p!r}; choose from {', '.join(peer_lib.PEERS)}")
            add(p, "-", lambda error=error: (_ for _ in ()).throw(error))


def _run_set(runners: dict, prompts: list[list[int]], name: str) -> list[MethodResult]:
    """Run one eval set's methods interleaved; each row counts its outputs identical to vanilla's."""
    run_interleaved({k: v for k, v in runners.items() if v[1] is not None}, prompts)
    vanilla = runners["vanilla -"][0]
    rows = []
    for res, _ in runners.values():
        res.identical = sum(a == b for a, b in zip(res.outputs, vanilla.outputs))
        rows.append(res)
        print(
            f"{name} {res.method} {res.tree}: tau {res.tau:.2f} {res.tokens_per_s:.1f} tok/s {res.error or ''}",
            file=sys.stderr,
        )
    return rows


def _batch_sweep(args, target, methods: list[str], sp, sizes: list[int], mixed: list[list[int]]):
    from moa_serve.benchmarks.batch import engine_batch_runner, run_batch_sweep
    from sglang_ext.tree import TreeShape

    cache: dict = {}
    max_new = args.max_new_tokens
    entries = [
        (
            "vanilla",
            "-",
            False,
            lambda: engine_batch_runner(target, "vanilla", TreeShape.chain(1), max_new, False, cache, sp),
        )
    ]
    for spec in methods:
        m, tree = _method_tree(spec, args.tree)
        entries.append(
            (
                m,
                tree.label,
                args.adaptive,
                lambda m=m, tree=tree: engine_batch_runner(target, m, tree, max_new, args.adaptive, cache, sp),
            )
        )
    return run_batch_sweep(
        entries,
        mixed,
        sizes,
        repeats=args.repeats,
        warmup_tokens=4 if args.quick else 16,
        log=lambda s: print(s, file=sys.stderr),
        min_prompts=1 if args.quick else args.sweep_min_prompts,
    )


def _gateway_overhead(args, target, methods: list[str]):
    from moa_serve.benchmarks.overhead import measure_gateway_overhead
    from sglang_ext.tree import TreeShape

    om = args.overhead_method or (methods[0].partition(":")[0] if methods else "vanilla")
    ospec = next((s for s in methods if s.partition(":")[0] == om), om)
    otree = TreeShape.chain(1) if ospec == "vanilla" else _method_tree(ospec, args.tree)[1]
    msgs = [{"role": "user", "content": "Explain in two sentences what a hash table is."}]
    return measure_gateway_overhead(
        target,
        om,
        otree,
        args.adaptive,
        msgs,
        args.overhead_tokens,
        args.overhead_requests,
        warmup=1 if args.quick else 5,
    )


def _write_results(args, target, sp, results, sweep, overhead, sizes: list[int], n_mixed: int) -> None:
    """results.json, table.md (printed too) and the --report markdown."""
    from moa_serve.benchmarks import peers as peer_lib

    command = (
        "moa-serve " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        if sys.argv[0].endswith("moa-serve")
        else "moa-serve bench ..."
    )
    sampling = peer_lib.sampling_label(sp)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llama_cpp = (
        peer_lib.llama_cpp_build() if any(r.method.startswith("llama.cpp") and not r.error for r in results) else None
    )
    payload = {
        "command": command,
        "machine": machine_description() + (f"; llama.cpp {llama_cpp}" if llama_cpp else ""),
        "dtype": target.model.dtype_name,
        "max_new_tokens": args.max_new_tokens,
        "sampling": {"temperature": sp.temperature, "top_p": sp.top_p, "seed": sp.seed, "label": sampling},
        "results": [_result_json(r) for r in results],
    }
    table = markdown_table(results, sampling=not sp.greedy) if results else ""
    sections = [table] if table else []
    sections += _acceptance_section(results, payload, out, sampling)
    if sweep:
        sections.append(_sweep_section(args, sweep, sizes, n_mixed, payload, out, sampling))
    if overhead:
        from moa_serve.benchmarks.overhead import overhead_json, overhead_table

        payload["gateway_overhead"] = overhead_json(overhead)
        sections.append(
            f"## Gateway overhead (one greedy chat request at a time, 127.0.0.1)\n\n{overhead_table(overhead)}"
        )
    table = "\n\n".join(sections)
    (out / "results.json").write_text(json.dumps(payload, indent=2))
    (out / "table.md").write_text(table + "\n")
    print(table)
    if args.report:
        for png in ("throughput_vs_batch.png", "acceptance_by_position.png"):
            table = table.replace(f"]({png})", f"]({os.path.relpath(out / png, Path(args.report).resolve().parent)})")
        Path(args.report).write_text(
            f"# Benchmarks\n\nCommand: `{command}`\n\n"
            f"Machine: {payload['machine']}; dtype {payload['dtype']}; {sampling}; {args.max_new_tokens} new tokens; "
            f"per-prompt table at batch size 1{'; batch sweep ' + args.batch_sizes if sweep else ''}.\n\n{table}\n"
        )


def _result_json(r: MethodResult) -> dict:
    return {
        **{k: v for k, v in asdict(r).items() if k != "outputs"},
        "tau": r.tau,
        "tokens_per_s": r.tokens_per_s,
        "draft_per_step": r.draft_per_step,
        "acceptance_by_position": r.acceptance_by_position,
        "skipped": bool(r.error and r.error.startswith("skipped:")),
    }


def _acceptance_section(results, payload: dict, out: Path, sampling: str) -> list[str]:
    accept = acceptance_table(results)
    if not accept:
        return []
    payload["acceptance_by_position"] = pooled_acceptance(results)
    plot = ""
    try:
        plot_tau_by_set(results, out / "tau_by_eval_set.png")
        if plot_acceptance(results, out / "acceptance_by_position.png"):
            plot = "\n\n![acceptance by draft position](acceptance_by_position.png)"
    except Exception as e:  # noqa: BLE001 - the numbers are still written
        print(f"plot failed: {type(e).__name__}: {e}", file=sys.stderr)
    return [
        "### Acceptance rate by draft position (fraction of verify steps that accepted draft position i; "
        f"{sampling})\n\n{accept}{plot}"
    ]


def _sweep_section(args, sweep, sizes: list[int], n_mixed: int, payload: dict, out: Path, sampling: str) -> str:
    from moa_serve.benchmarks.batch import batch_grid_table, batch_json, batch_rows_table, plot_throughput

    payload["batch_sweep"] = {
        "batch_sizes": sizes,
        "adaptive": args.adaptive,
        "repeats": args.repeats,
        "min_prompts": args.sweep_min_prompts,
        "eval_sets": args.eval_sets.split(","),
        "distinct_prompts": n_mixed,
        "memory": (
            "peak process RSS (psutil, sampled every 5 ms) during the row's measured run(s) "
            "(all engines alive at that batch size included), and its rise over the RSS when the run started"
        ),
        "rows": batch_json(sweep),
    }
    try:
        plot_throughput(sweep, out / "throughput_vs_batch.png")
    except Exception as e:  # noqa: BLE001 - the numbers are still written
        print(f"plot failed: {type(e).__name__}: {e}", file=sys.stderr)
    return (
        f"## Throughput vs batch size ({args.max_new_tokens} new tokens, {sampling}, {args.repeats} repeat(s); at "
        f"batch size b, max({args.sweep_min_prompts}, 2b) prompts served b at a time with continuous "
        f"batching)\n\n{batch_rows_table(sweep)}\n\n"
        f"### tok/s (× vanilla at the same batch size), whole run\n\n{batch_grid_table(sweep)}\n\n"
        "### tok/s (× vanilla at the same batch size) at full batch: steps with b requests in the engine (steady "
        f"load of b clients; the drain tail excluded)\n\n{batch_grid_table(sweep, steady=True)}\n\n"
        "![throughput vs batch size](throughput_vs_batch.png)"
    )
