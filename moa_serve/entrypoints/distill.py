"""`moa-serve distill`: regenerate the assistant answers of a conversation set with the target itself.

A drafter is scored on how well it predicts the *target's* next token. ShareGPT answers were written
by other models, so a drafter trained on them partly learns a distribution the target never
produces; training on the target's own answers (self-distillation, as Medusa-2 and SpecForge's
regenerate step do) aims the drafter at what it will actually be asked to predict.

For each conversation, the first user turn (after an optional system prompt) goes through the
embedded engine (continuous batching; greedy unless --temperature > 0), or with --base-url through a
running server (ours, SGLang, vLLM: sglang_ext/training/regenerate.py; --concurrency requests in
flight, failures retried with backoff), and the target's answer replaces the original. `--turns N`
answers the first N user turns (0: all), each later turn after the target's own earlier answers;
`--samples K` (with --temperature > 0) answers each conversation K times, seeds --seed .. --seed+K-1
(sglang_ext/training/dialogues.py). Output: SpecForge-style jsonl, one record per answer, written as it
finishes, so an interrupted run resumes where it stopped (`--resume` asks only the turns not yet written):

    {"id": "...", "conversations": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}],
     "finish_reason": "stop" | "length", "prompt_ids": [...], "output_ids": [...], "sample": 0, "turn": 1}

prompt_ids are the chat template's rendering of the prompt (a later turn's holds the earlier turns),
output_ids the answer's tokens as the target sampled them (re-tokenized with its tokenizer and chat
template where a server returns text only).
`--shards DIR` then packs every record of --out into the token shards the trainer reads (source
`distill:<name of --out>`, the loss mask on the answers). The shared eval prompts are excluded exactly
as in training.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from moa_serve.entrypoints.flags import add_model_args, engine_config


def add_distill_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "distill", help="regenerate conversation answers with the target (self-distilled drafter training data)"
    )
    add_model_args(p, model_help="the target: 'smollm2' or a local HF Llama/Qwen directory")
    p.add_argument(
        "--data", default="sharegpt", help="'sharegpt' or a .json/.jsonl conversation file (prompts are taken from it)"
    )
    p.add_argument("--out", required=True, help="output .jsonl (appended to with --resume)")
    p.add_argument("--num-conversations", type=int, default=1000, help="conversations answered (resumed ones included)")
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=768,
        help="skip conversations whose first prompt is longer; a dialogue ends at a turn whose prompt is longer",
    )
    p.add_argument("--turns", type=int, default=1, help="user turns answered per conversation (0: every one)")
    p.add_argument(
        "--samples", type=int, default=1, help="answers per conversation (needs --temperature > 0), seeds --seed + k"
    )
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
    p.add_argument("--resume", action="store_true", help="keep the records already in --out and ask only the rest")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--shards", default=None, help="also pack every record of --out into token shards here")
    r = p.add_argument_group("a running server (--base-url): the target's answers through its API")
    r.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (ours, SGLang, vLLM, OpenAI-style)")
    r.add_argument("--api-key", default=None, help="sent as a Bearer token")
    r.add_argument("--api", default="auto", choices=["auto", "generate", "chat"], help="auto: /generate, else chat")
    r.add_argument("--model-name", default=None, help="the served model's name for chat (default: its first)")
    r.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    r.add_argument("--max-retries", type=int, default=6, help="tries after a failure that may pass, per prompt")
    r.add_argument("--retry-backoff", type=float, default=1.0, help="seconds before the first retry (doubling)")
    p.set_defaults(handler=cmd_distill)
    return p


def turn_queue(source: str, encode, args, done: dict | None = None):
    """The turns to answer (sglang_ext.training.dialogues.TurnQueue), eval prompts excluded."""
    from sglang_ext.training.data import eval_prompts, open_conversations
    from sglang_ext.training.dialogues import TurnQueue

    return TurnQueue(
        open_conversations(source, eval_prompts()),
        encode,
        args.max_prompt_tokens,
        args.num_conversations,
        turns=args.turns,
        samples=args.samples,
        seed=args.seed,
        done=done,
    )


def distill(engine, decode, queue, params, batch_size: int, write) -> int:
    """Keep up to batch_size turns running; write(record) as each finishes, then queue its dialogue's next
    turn. Returns the records written."""
    running: dict[int, tuple[object, object]] = {}
    written = 0
    while True:
        while len(running) < batch_size and (turn := queue.pop()) is not None:
            sp = params if turn.seed is None else replace(params, seed=turn.seed)
            req = engine.add_request(turn.prompt_ids, sp)
            running[req.rid] = (turn, req)
        if not running:
            return written
        for ev in engine.step():
            r = ev.request
            if r.finished and r.rid in running:
                turn, _ = running.pop(r.rid)
                if r.finish_reason in ("stop", "length"):
                    text = decode(r.output_ids)
                    write(record(turn, text, r.finish_reason, list(r.output_ids)))
                    written += 1
                    queue.answered(turn, text)


def record(turn, answer: str, finish_reason: str, output_ids) -> dict:
    """The record of one answered turn (a dialogues.Turn or anything with its fields)."""
    return {
        "id": turn.id,
        "conversations": list(turn.messages) + [{"role": "assistant", "content": answer}],
        "finish_reason": finish_reason,
        "prompt_ids": list(turn.prompt_ids),
        "output_ids": list(output_ids),
        "sample": turn.dialogue.sample,
        "turn": turn.turn,
    }


def cmd_distill(args) -> int:
    from sglang_ext.training.data import DataError

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    if out.exists() and not args.resume:
        raise SystemExit(f"{out} exists: pass --resume to continue it, or choose another --out")
    if args.turns < 0 or args.samples < 1 or args.num_conversations < 1:
        raise SystemExit("--turns must be >= 0, --samples and --num-conversations >= 1")
    if args.samples > 1 and args.temperature <= 0:
        raise SystemExit("--samples > 1 needs --temperature > 0 (greedy answers would all be the same)")
    done = _done(out) if args.resume else {}
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        _remote(args, out, done) if args.base_url else _embedded(args, out, done)
    except DataError as e:
        raise SystemExit(str(e)) from None
    if args.shards:
        _pack(args, out)
    return 0


def _done(out: Path) -> dict:
    """The records already in --out, by (id, sample, turn)."""
    from sglang_ext.training.dialogues import record_key

    if not out.is_file():
        return {}
    # iterate lines, not str.splitlines(): answers may hold U+2028 etc., which json.dumps leaves raw
    with open(out, encoding="utf-8") as f:
        return {record_key(rec): rec for rec in (json.loads(line) for line in f if line.strip())}


class _Writer:
    """Appends records to --out as they come (one flushed line each) and shows progress."""

    def __init__(self, out: Path, todo: int | None, show: bool):
        self.f = open(out, "a", encoding="utf-8")
        self.out, self.written, self.tokens, self.t0 = out, 0, 0, time.time()
        self.bar = None
        if show:
            from tqdm import tqdm

            self.bar = tqdm(total=todo, unit="answer", desc="distill")

    def __call__(self, rec: dict) -> None:
        self.f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self.f.flush()
        self.written += 1
        self.tokens += len(rec["output_ids"])
        if self.bar:
            self.bar.update(1)
            self.bar.set_postfix(tokens=self.tokens)

    def close(self) -> None:
        self.f.close()
        if self.bar:
            self.bar.close()
        dt = time.time() - self.t0
        print(
            f"distill: {self.written} answers, {self.tokens} tokens in {dt:.0f}s "
            f"({self.tokens / max(dt, 1e-9):.1f} tok/s) -> {self.out}",
            file=sys.stderr,
        )


def _embedded(args, out: Path, done: dict) -> None:
    """The answers of the embedded engine (continuous batching)."""
    from serving.engine import build_engine
    from sglang_ext.sampling import SamplingParams

    kv_slots = args.batch_size * (args.max_prompt_tokens + args.max_new_tokens + 64) + 1024
    engine = build_engine(engine_config(args, kv_slots=kv_slots, adaptive=True))  # adaptive only with a drafter
    target = engine.target
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    queue = turn_queue(args.data, target.encode_chat, args, done)
    write = _Writer(out, _todo(args, done), not args.no_progress)
    try:
        distill(engine, lambda ids: _decode(target.tokenizer, ids), queue, params, args.batch_size, write)
    finally:
        write.close()


def _todo(args, done: dict) -> int | None:
    """Answers still to come when every conversation has its turns (a bound: dialogues may end earlier)."""
    return None if args.turns != 1 else max(0, args.num_conversations * args.samples - len(done))


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True).strip()


def _remote(args, out: Path, done: dict) -> None:
    """The answers of a running server; prompts it refuses (4xx) are reported one line each."""
    from sglang_ext.models import Target
    from sglang_ext.models.loader import load_tokenizer, resolve_target
    from sglang_ext.training.regenerate import RemoteConfig, RemoteTarget, ServerError, regenerate

    path = resolve_target(args.model)
    target = Target(model=None, tokenizer=load_tokenizer(path), path=path)  # the tokenizer and chat template only
    cfg = RemoteConfig(
        args.base_url, args.api_key, args.model_name, args.api, args.concurrency, args.max_retries, args.retry_backoff
    )
    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p}
    remote = RemoteTarget(cfg, params | {"seed": args.seed}, target.tokenizer)
    queue = turn_queue(args.data, target.encode_chat, args, done)
    write, refused = _Writer(out, _todo(args, done), not args.no_progress), 0
    try:
        for ans in regenerate(remote, queue):
            if ans.refused is not None:
                refused += 1
                print(f"distill: prompt {ans.prompt.id} refused by the server: {ans.refused}", file=sys.stderr)
                continue
            answer = ans.text.strip() if ans.retokenized else _decode(target.tokenizer, ans.output_ids)
            write(record(ans.prompt, answer, ans.finish_reason, ans.output_ids))
            queue.answered(ans.prompt, answer)
    except ServerError as e:
        raise ServerError(f"{e} ({write.written} answers written to {out}; rerun with --resume to continue)") from None
    finally:
        write.close()
        remote.close()
    if refused:
        print(f"distill: {refused} prompts refused by the server (above); --resume retries them", file=sys.stderr)


def _pack(args, out: Path) -> None:
    """Every record of --out as token shards (source distill:<name>), the mask on the answers."""
    from sglang_ext.models.loader import load_tokenizer, resolve_target
    from sglang_ext.training.shards import pack, record_examples

    tok = load_tokenizer(resolve_target(args.model))
    name = f"distill:{out.stem}"
    manifest = pack(args.shards, {name: record_examples(out)}, len(tok), meta={"target": args.model, "data": str(out)})
    print(
        f"distill: {manifest['examples']} answers, {manifest['tokens']} tokens -> shards in {args.shards}",
        file=sys.stderr,
    )
