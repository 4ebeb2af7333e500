"""`moa-serve` command line: generate, bench (and serve / train as they land)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from entrypoints.flags import add_model_args, add_spec_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moa-serve", description="Speculative decoding with EAGLE-3 / MoA drafters")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion for one prompt")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user turn")
    add_model_args(g)
    add_spec_args(g)
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

    from entrypoints.bench import add_bench_parser
    from entrypoints.serve import add_serve_parser

    add_bench_parser(sub)
    add_serve_parser(sub)
    from entrypoints.train import add_train_parser

    add_train_parser(sub)
    from entrypoints.distill import add_distill_parser

    add_distill_parser(sub)
    from entrypoints.corpus import add_corpus_parser

    add_corpus_parser(sub)
    from benchmarks.edge import add_edge_parsers

    add_edge_parsers(sub)
    return parser


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
    from serving.engine import Engine
    from sglang_ext.drafters import default_tree, make_drafter, resolve_drafter
    from sglang_ext.models import load_target
    from sglang_ext.sampling import SamplingParams
    from sglang_ext.tree import TreeShape

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
    from entrypoints.bench import cmd_bench

    handlers["bench"] = cmd_bench
    from entrypoints.serve import cmd_serve

    handlers["serve"] = cmd_serve
    from entrypoints.train import cmd_train

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
