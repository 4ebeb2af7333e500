"""`moa-serve` command line: generate, bench (and serve / train as they land)."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import sys
import time

from moa_serve.entrypoints.flags import (
    add_generation_args,
    add_model_args,
    add_spec_args,
    engine_config,
    generation_json,
    sampling_params,
)

# The extra (pyproject.toml [project.optional-dependencies]) a command needs to run, beyond the core package.
# Every command's --help needs only the core: the modules that build the parser import no extra's package.
COMMAND_EXTRAS = {
    "serve": "serve",
    "edge": "serve",
    "train": "train",
    "distill": "train",
    "bench": "bench",
    "edge-bench": "bench",
}


def missing_extra(extra: str) -> list[str]:
    """The import names of the packages that `extra` declares (as installed: the package's own metadata) and
    that are not importable; [] when all are, or when the package runs from a source tree without metadata."""
    from packaging.requirements import Requirement

    try:
        declared = [Requirement(r) for r in importlib.metadata.requires("moa-serve") or []]
    except importlib.metadata.PackageNotFoundError:
        return []
    missing = []
    for req in declared:
        if req.marker is None or not req.marker.evaluate({"extra": extra}):
            continue
        if req.name == "moa-serve":  # all = moa-serve[serve,...]: the extras it names
            missing += [m for e in sorted(req.extras) for m in missing_extra(e)]
            continue
        module = req.name.lower().replace("-", "_")  # each declared distribution's import name
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:
            found = False
        if not found:
            missing.append(module)
    return missing


def require_extra(command: str) -> None:
    extra = COMMAND_EXTRAS.get(command)
    missing = missing_extra(extra) if extra else []
    if missing:
        raise RuntimeError(
            f"needs the {extra!r} extra (not installed: {', '.join(missing)}): pip install 'moa-serve[{extra}]'"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moa-serve", description="Speculative decoding with EAGLE-3 / MoA drafters")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion for one prompt")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user turn")
    add_model_args(g)
    add_spec_args(g)
    add_generation_args(g)

    from moa_serve.entrypoints.bench import add_bench_parser
    from moa_serve.entrypoints.serve import add_serve_parser

    add_bench_parser(sub)
    add_serve_parser(sub)
    from moa_serve.entrypoints.train import add_train_parser

    add_train_parser(sub)
    from moa_serve.entrypoints.distill import add_distill_parser

    add_distill_parser(sub)
    from moa_serve.entrypoints.corpus import add_corpus_parser

    add_corpus_parser(sub)
    from moa_serve.entrypoints.edge import add_edge_parsers

    add_edge_parsers(sub)
    return parser


def cmd_generate(args) -> int:
    from serving.engine import build_engine

    params = sampling_params(args)
    if not args.prompt.strip():
        raise ValueError("prompt is empty")
    engine = build_engine(engine_config(args))  # a bad --tree fails before the model loads
    target, cfg = engine.target, engine.config
    ids = target.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else target.encode(args.prompt)
    t0 = time.perf_counter()
    req = engine.generate([ids], params)[0]
    dt = time.perf_counter() - t0
    text = target.decode(req.output_ids)
    st = req.stats
    if args.json:
        stats = {
            "accept_length": round(st.accept_length, 4),
            "draft_tokens_per_step": round(st.draft_tokens / max(st.verify_steps, 1), 4),
            "verify_steps": st.verify_steps,
            "tokens_per_s": round(len(req.output_ids) / dt, 3),
        }
        if engine.drafter is not None and engine.drafter.member_names:  # merged: draft / accepted tokens per member
            stats["members"] = engine.drafter.member_stats()
        print(generation_json(text, req.output_ids, req.finish_reason, stats, cfg.drafter, cfg.tree))
    else:
        print(text)
        print(
            f"[{len(req.output_ids)} tokens, {len(req.output_ids) / dt:.1f} tok/s, accept length "
            f"{st.accept_length:.2f}, {cfg.drafter}]",
            file=sys.stderr,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {"generate": cmd_generate}
    from moa_serve.entrypoints.bench import cmd_bench

    handlers["bench"] = cmd_bench
    from moa_serve.entrypoints.serve import cmd_serve

    handlers["serve"] = cmd_serve
    from moa_serve.entrypoints.train import cmd_train

    handlers["train"] = cmd_train
    try:
        require_extra(args.command)
        if getattr(args, "handler", None):
            return args.handler(args)
        return handlers[args.command](args)
    except (ValueError, FileNotFoundError, RuntimeError, ImportError) as e:
        # every library error is a clear message, not a traceback (a missing package too: require_extra names
        # the extra of a declared one)
        print(f"moa-serve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
