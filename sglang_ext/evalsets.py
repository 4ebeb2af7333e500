"""Evaluation prompts: EAGLE's six sets from ../shared/data/eval when present, else a built-in set.

Format (one JSON object per line): {"question_id", "category", "turns": [first user turn, ...]}.
"""

from __future__ import annotations

import json
from pathlib import Path

from .settings import settings

EVAL_SETS = ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum", "qa")

BUILTIN_PROMPTS = {
    "builtin": [
        "Write a short story about a robot who learns to paint.",
        "Explain how a hash table works and when to use one.",
        "Write a Python function that returns the n-th Fibonacci number iteratively.",
        "What are the main causes of the French Revolution?",
        "Give three tips for staying productive when working from home.",
        "Summarize the water cycle in a few sentences.",
        "Janet has 3 apples and buys 5 more. She gives 2 to a friend. How many apples does she have?",
        "Compose a polite email asking a colleague to review a document by Friday.",
    ]
}


def eval_dir() -> Path | None:
    """$MOA_SERVE_EVAL_DIR, else ../shared/data/eval beside the repo (None when absent)."""
    env = settings().eval_dir
    candidates = [env] if env is not None else []
    candidates.append(Path(__file__).resolve().parents[1].parent / "shared" / "data" / "eval")
    for c in candidates:
        if c.is_dir() and any(c.glob("*.jsonl")):
            return c
    return None


def read_prompts(path: Path) -> list[str]:
    """First user turn of each record in an EAGLE-format jsonl file."""
    prompts = []
    for n, line in enumerate(
        path.read_text(encoding="utf-8").split("\n"), 1
    ):  # not splitlines(): U+2028 may sit in a string
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            turn = rec["turns"][0]
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
            raise ValueError(f"{path}:{n}: not an eval record with 'turns' ({e})") from e
        if not isinstance(turn, str) or not turn.strip():
            raise ValueError(f"{path}:{n}: first turn is empty")
        prompts.append(turn)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def load_eval_set(name_or_path: str, limit: int | None = None) -> tuple[str, list[str]]:
    """(set name, prompts) for one of EVAL_SETS, a jsonl path, or 'builtin'. Falls back to builtin."""
    if name_or_path == "builtin":
        prompts = BUILTIN_PROMPTS["builtin"]
        name = "builtin"
    elif name_or_path.endswith(".jsonl"):
        prompts, name = read_prompts(Path(name_or_path)), Path(name_or_path).stem
    else:
        d = eval_dir()
        if d is None or not (d / f"{name_or_path}.jsonl").exists():
            if name_or_path not in EVAL_SETS:
                raise ValueError(
                    f"unknown eval set {name_or_path!r}; choose from {', '.join(EVAL_SETS)}, builtin, or a .jsonl path"
                )
            prompts, name = BUILTIN_PROMPTS["builtin"], "builtin"
        else:
            prompts, name = read_prompts(d / f"{name_or_path}.jsonl"), name_or_path
    return name, prompts[:limit] if limit else prompts
