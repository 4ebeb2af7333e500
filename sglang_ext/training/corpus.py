"""`moa-serve build-corpus`: the suffix drafter's seed corpus from the target's own answers.

Input: conversation files, normally the output of `moa-serve distill` (the target's greedy answers
to ShareGPT prompts, eval prompts excluded). Every assistant turn is tokenized with the target's
tokenizer; an answer that ended naturally (`finish_reason` "stop", or no finish_reason recorded) is
followed by the end-of-turn token, so the drafter also learns where answers end. Output: a corpus
directory (config.json + corpus.npz) that `--drafter PATH` or the shipped `--drafter suffix` loads.
"""

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


def corpus_docs(
    sources: list[str], encode, end_id: int | None, max_docs: int | None = None
) -> tuple[list[list[int]], int]:
    """(token docs, conversations read): assistant turns of each conversation (eval prompts excluded,
    as in training), end-of-turn appended unless the answer was cut off."""
    from .data import eval_prompts, open_conversations

    excluded = eval_prompts()
    docs: list[list[int]] = []
    n_conv = 0
    for source in sources:
        for conv in open_conversations(source, excluded):
            n_conv += 1
            answers = [m["content"] for m in conv.messages if m["role"] == "assistant"]
            for j, text in enumerate(answers):
                ids = list(encode(text))
                if end_id is not None and (conv.finish_reason in (None, "stop") or j < len(answers) - 1):
                    ids.append(end_id)
                docs.append(ids)
                if max_docs is not None and len(docs) >= max_docs:
                    return docs, n_conv
    return docs, n_conv


def cmd_build_corpus(args) -> int:
    from sglang_ext.drafters.suffix import save_corpus
    from sglang_ext.models.loader import load_config, load_tokenizer, resolve_target

    from .data import DataError

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
