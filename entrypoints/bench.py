"""`moa-serve bench`: vanilla vs each drafter (and peers) on the same prompts, in one run
(benchmarks/bench.py, benchmarks/batch.py)."""

from __future__ import annotations

import itertools
import json
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.bench import (
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
    from benchmarks import peers as peer_lib
    from sglang_ext.drafters import default_tree
    from sglang_ext.drafters.draft_model import default_self_draft_layers
    from sglang_ext.evalsets import load_eval_set
    from sglang_ext.models import load_target, parse_dtype
    from sglang_ext.sampling import SamplingParams
    from sglang_ext.tree import TreeShape

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
        from benchmarks.batch import engine_batch_runner, run_batch_sweep

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
        from benchmarks.batch import measure_gateway_overhead

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
        from benchmarks.batch import batch_grid_table, batch_json, batch_rows_table, plot_throughput

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
        from benchmarks.batch import overhead_json, overhead_table

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
