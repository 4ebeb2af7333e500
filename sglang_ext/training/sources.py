"""A run's training examples, by source: conversations tokenised with the target's chat template, token
shards read as they are, or (--smoke without data) synthetic answers.

    sharegpt | *.json | *.jsonl      a seeded sample of num_examples conversations (2000 when unset),
                                     tokenised (needs the target's tokenizer) and cached in <out>/examples.pt,
                                     so a resumed run trains on the very same examples even if the file has
                                     grown since
    a shard directory                every window of max_len tokens of each source it holds

Every source is cut to its first max_examples examples; sources named `distill:*` are the target's own
answers (what the draft vocab is picked from and what --distill-repeat repeats).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import torch

from .config import TrainConfig, TrainError
from .data import Example, build_examples, eval_prompts, open_conversations, token_counts
from .shards import MANIFEST, load_examples_by_source, read_manifest

SMOKE_VOCAB = 49152  # SmolLM2's, when --smoke has no data to take it from
EXAMPLES_CACHE = "examples.pt"
CONVERSATIONS = 2000  # tokenised per conversation file when num_examples is unset


def is_shards(source: str) -> bool:
    return (Path(source) / MANIFEST).is_file()


def data_vocab(cfg: TrainConfig) -> int | None:
    """The vocab size the token shards were made for (one for all of them), None without shards."""
    sizes = {read_manifest(s)["vocab_size"] for s in cfg.data if is_shards(s)}
    if len(sizes) > 1:
        raise TrainError(f"the shard directories were made for different vocabularies: {sorted(sizes)}")
    return sizes.pop() if sizes else (SMOKE_VOCAB if cfg.smoke and not cfg.data else None)


def load_sources(cfg: TrainConfig, tokenizer, cache_dir: Path) -> dict[str, list[Example]]:
    """Source name -> its examples (see the module docstring)."""
    if not cfg.data:
        return {"distill:smoke": smoke_examples(SMOKE_VOCAB, cfg.seed)}
    out: dict[str, list[Example]] = {}
    talks = [s for s in cfg.data if not is_shards(s)]
    if talks:
        out.update(_conversations(cfg, talks, tokenizer, cache_dir))
    for s in cfg.data:
        if is_shards(s):
            for name, exs in load_examples_by_source(s, cfg.max_len, limit=cfg.max_examples).items():
                out.setdefault(name, []).extend(exs)
    return {k: v[: cfg.max_examples] for k, v in out.items() if v}


def _conversations(cfg: TrainConfig, sources: list[str], tokenizer, cache_dir: Path) -> dict[str, list[Example]]:
    cache = cache_dir / EXAMPLES_CACHE
    num = cfg.num_examples or CONVERSATIONS
    key = {"sources": sources, "num_examples": num, "max_len": cfg.max_len, "seed": cfg.seed}
    raw = torch.load(cache, weights_only=True) if cache.is_file() else {}
    if raw.get("key") == key:
        return {n: [Example(i, m) for i, m in zip(r["input_ids"], r["loss_mask"])] for n, r in raw["sources"].items()}
    if tokenizer is None:
        raise TrainError(f"conversations ({', '.join(sources)}) need the target's tokenizer; use token shards")
    out = {}
    for s in sources:
        convs = open_conversations(s, eval_prompts())
        out[source_name(s)] = build_examples(tokenizer, convs, num, cfg.max_len, seed=cfg.seed)
    cache.parent.mkdir(parents=True, exist_ok=True)
    rows = {n: {"input_ids": [e.input_ids for e in v], "loss_mask": [e.loss_mask for e in v]} for n, v in out.items()}
    tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")  # (every rank writes the same examples: the last wins)
    torch.save({"key": key, "sources": rows}, tmp)
    tmp.replace(cache)
    return out


def source_name(source: str) -> str:
    return source if source == "sharegpt" else Path(source).name


def smoke_examples(vocab_size: int, seed: int, n: int = 48) -> list[Example]:
    """Prompt + answer sequences over a few hundred token ids, the answers repetitive (something to learn)."""
    g = torch.Generator().manual_seed(seed)
    ids_range = min(vocab_size, 400)
    out = []
    for i in range(n):
        prompt = torch.randint(0, ids_range, (4 + i % 7,), generator=g)
        answer = torch.randint(0, ids_range, (3 + i % 4,), generator=g).repeat(6)[: 12 + i % 29]
        mask = torch.cat([torch.zeros(len(prompt), dtype=torch.bool), torch.ones(len(answer), dtype=torch.bool)])
        out.append(Example(torch.cat([prompt, answer]), mask))
    return out


def split_examples(by_source: dict[str, list[Example]], cfg: TrainConfig) -> tuple[list[Example], list[Example]]:
    """-> training examples (the target's answers repeated, at most num_examples: a seeded sample), held-out
    examples (a seeded sample of each source)."""
    rng = random.Random(cfg.seed)
    train, held = [], []
    for name, exs in by_source.items():
        exs = list(exs)
        rng.shuffle(exs)
        k = max(1, int(len(exs) * cfg.holdout)) if cfg.holdout and len(exs) > 1 else 0
        held += exs[:k]
        train += exs[k:] * (cfg.distill_repeat if name.startswith("distill") else 1)
    if cfg.num_examples is not None and len(train) > cfg.num_examples:
        train = rng.sample(train, cfg.num_examples)
    return train, held


def vocab_counts(cfg: TrainConfig, by_source: dict[str, list[Example]], vocab_size: int, tokenizer) -> torch.Tensor:
    """[V] assistant-token counts the draft vocab is picked from: the target's own answers (sources named
    distill:*) when there are any, else every source; with vocab_examples, of a larger seeded sample of
    the conversations (so the vocab generalises beyond the ones trained on)."""
    own = [e for n, exs in by_source.items() if n.startswith("distill") for e in exs]
    pool = own or [e for exs in by_source.values() for e in exs]
    talks = [s for s in cfg.data if not is_shards(s)]
    if cfg.vocab_examples <= len(pool) or not talks or tokenizer is None:
        return token_counts(pool, vocab_size)
    convs = (c for s in talks for c in open_conversations(s, eval_prompts()))
    return token_counts(build_examples(tokenizer, convs, cfg.vocab_examples, cfg.max_len, seed=cfg.seed), vocab_size)
