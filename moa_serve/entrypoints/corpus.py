"""`moa-serve build-corpus`: the suffix drafter's corpus from the target's own answers
(sglang_ext/training/corpus.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_corpus_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "build-corpus", help="build a suffix-drafter corpus from the target's own answers (moa-serve distill output)"
    )
    p.add_argument("--data", action="append", required=True, help=".json/.jsonl conversation file (repeatable)")
    p.add_argument("--out", required=True, help="output directory (config.json + corpus.npz)")
    p.add_argument("--model", default="smollm2", help="the target whose tokenizer is used")
    p.add_argument("--max-docs", type=int, default=None, help="keep at most this many answers (in file order)")
    p.set_defaults(handler=cmd_build_corpus)
    return p


def cmd_build_corpus(args) -> int:
    from sglang_ext.drafters.suffix import save_corpus
    from sglang_ext.models.loader import load_config, load_tokenizer, resolve_target
    from sglang_ext.training.corpus import corpus_docs
    from sglang_ext.training.data import DataError

    path = resolve_target(args.model)
    cfg, tok = load_config(path), load_tokenizer(path)
    end_id = tok.eos_token_id
    try:
        docs, n_conv = corpus_docs(args.data, lambda t: tok.encode(t, add_special_tokens=False), end_id, args.max_docs)
    except DataError as e:
        raise SystemExit(str(e)) from None
    meta = {
        "target": path.name,
        "vocab_size": cfg.vocab_size,
        "sources": [Path(d).name for d in args.data],
        "end_of_turn_id": end_id,
        "built_with": "moa-serve build-corpus " + " ".join(sys.argv[2:]),
    }
    out = save_corpus(args.out, docs, meta)
    print(
        f"build-corpus: {len(docs)} answers, {sum(map(len, docs))} tokens from {n_conv} conversations -> {out}",
        file=sys.stderr,
    )
    return 0
