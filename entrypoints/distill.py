"""`moa-serve distill`: regenerate the assistant answers of a conversation set with the target itself.

A drafter is scored on how well it predicts the *target's* next token. ShareGPT answers were written
by other models, so a drafter trained on them partly learns a distribution the target never
produces; training on the target's own answers (self-distillation, as Medusa-2 and SpecForge's
regenerate step do) aims the drafter at what it will actually be asked to predict.

For each conversation, the first user turn (after an optional system prompt) goes through the
embedded engine (continuous batching; greedy unless --temperature > 0) and the target's answer
replaces the original. Output: SpecForge-style jsonl, one record per line, written as each answer
finishes, so an interrupted run resumes where it stopped (`--resume` skips ids already written):

    {"id": "...", "conversations": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}],
     "finish_reason": "stop" | "length"}

The shared eval prompts are excluded exactly as in training.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Iterator

import torch

from entrypoints.flags import add_model_args, engine_config


def add_distill_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "distill", help="regenerate conversation answers with the target (self-distilled drafter training data)"
    )
    add_model_args(p, model_help="the target: 'smollm2' or a local HF Llama/Qwen directory")
    p.add_argument(
        "--data", default="sharegpt", help="'sharegpt' or a .json/.jsonl conversation file (prompts are taken from it)"
    )
    p.add_argument("--out", required=True, help="output .jsonl (appended to with --resume)")
    p.add_argument("--num-conversations", type=int, default=1000)
    p.add_argument("--max-prompt-tokens", type=int, default=768, help="skip conversations whose prompt is longer")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=32, help="requests decoded together (continuous batching)")
    p.add_argument(
        "--drafter",
        default="none",
        help="speed up generation with a drafter (lossless: same answers); 'none' = plain decoding",
    )
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy answers (what a greedy-served drafter sees)"
    )
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--resume", action="store_true", help="keep the records already in --out and skip their ids")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(handler=cmd_distill)
    return p


def prompts_from(
    source: str, tokenizer_encode, max_prompt_tokens: int, skip_ids: set[str]
) -> Iterator[tuple[str, list[dict], list[int]]]:
    """(id, prompt messages, prompt token ids) for each usable conversation, eval prompts excluded."""
    from sglang_ext.training.data import eval_prompts, open_conversations

    for conv in open_conversations(source, eval_prompts()):
        if conv.id in skip_ids:
            continue
        first_user = next(i for i, m in enumerate(conv.messages) if m["role"] == "user")
        messages = conv.messages[: first_user + 1]
        ids = tokenizer_encode(messages)
        if len(ids) <= max_prompt_tokens:
            yield conv.id, messages, ids


def distill(
    engine,
    decode,
    prompts: Iterator[tuple[str, list[dict], list[int]]],
    params,
    limit: int,
    batch_size: int,
    write,
    progress=None,
) -> int:
    """Keep up to batch_size requests running; write(record) as each finishes. Returns records written."""
    running: dict[int, tuple[str, list[dict], object]] = {}
    written, exhausted = 0, False
    while written < limit:
        while not exhausted and len(running) < batch_size and written + len(running) < limit:
            item = next(prompts, None)
            if item is None:
                exhausted = True
                break
            cid, messages, ids = item
            req = engine.add_request(ids, params)
            running[req.rid] = (cid, messages, req)
        if not running:
            break
        for ev in engine.step():
            r = ev.request
            if r.finished and r.rid in running:
                cid, messages, _ = running.pop(r.rid)
                if r.finish_reason in ("stop", "length"):
                    answer = decode(r.output_ids)
                    write(
                        {
                            "id": cid,
                            "conversations": messages + [{"role": "assistant", "content": answer}],
                            "finish_reason": r.finish_reason,
                        }
                    )
                    written += 1
                    if progress:
                        progress(len(r.output_ids))
    for _, _, req in running.values():  # limit reached with requests in flight
        engine.abort(req)
    return written


def cmd_distill(args) -> int:
    from serving.engine import build_engine
    from sglang_ext.sampling import SamplingParams
    from sglang_ext.training.data import DataError

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    if out.exists() and not args.resume:
        raise SystemExit(f"{out} exists: pass --resume to continue it, or choose another --out")
    done: set[str] = set()
    if args.resume and out.is_file():
        # iterate lines, not str.splitlines(): answers may hold U+2028 etc., which json.dumps leaves raw
        with open(out, encoding="utf-8") as f:
            done = {json.loads(line)["id"] for line in f if line.strip()}
    kv_slots = args.batch_size * (args.max_prompt_tokens + args.max_new_tokens + 64) + 1024
    engine = build_engine(engine_config(args, kv_slots=kv_slots, adaptive=True))  # adaptive only with a drafter
    target = engine.target
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    tok = target.tokenizer

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True).strip()

    try:
        prompts = prompts_from(args.data, target.encode_chat, args.max_prompt_tokens, done)
    except DataError as e:
        raise SystemExit(str(e)) from None
    todo = args.num_conversations - len(done)
    if todo <= 0:
        print(f"{out}: already {len(done)} records", file=sys.stderr)
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=todo, unit="conv", desc="distill")
    tokens = [0]

    def progress(n: int) -> None:
        tokens[0] += n
        if bar:
            bar.update(1)
            bar.set_postfix(tokens=tokens[0])

    t0 = time.time()
    with open(out, "a", encoding="utf-8") as f:

        def write(rec: dict) -> None:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            f.flush()

        try:
            n = distill(engine, decode, prompts, params, todo, args.batch_size, write, progress)
        except DataError as e:
            raise SystemExit(str(e)) from None
    if bar:
        bar.close()
    dt = time.time() - t0
    print(
        f"distill: {n} answers, {tokens[0]} tokens in {dt:.0f}s ({tokens[0] / max(dt, 1e-9):.1f} tok/s) -> {out}",
        file=sys.stderr,
    )
    return 0
