"""Soak test: mixed load against a running gateway for a while, every API feature at once, plus bad
requests and streams dropped mid-way; then checks the server still answers the same greedy text and
prints what each kind of request got. With --pid it samples the server's RSS every 10 s (a leak shows
as growth after warm-up).

    .venv/bin/moa-serve serve &            # or make serve
    .venv/bin/python scripts/soak.py --seconds 540 --users 12 --pid $(pgrep -f "moa-serve serve")

Kinds: plain (greedy or sampled), stream (include_usage), n2, tools (required or auto), json (json_object),
pred (a predicted output), logprobs, minstop (min_tokens + stop), completion (echo or not), drop (hang up
after a few events), bad (six malformed requests: each must get a 4xx with an error body).
"""

import argparse
import asyncio
import json
import os
import random
import time

import httpx
from openai import APIStatusError, AsyncOpenAI, BadRequestError

BASE = "http://127.0.0.1:8000"
cli: AsyncOpenAI
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
PROMPTS = [
    "Name three colors.",
    "Write a python function that adds two numbers.",
    "What is 12*7?",
    "Tell me a joke about cats.",
    "Summarize: The quick brown fox jumps over the lazy dog.",
]
stats = {}


def count(k):
    stats[k] = stats.get(k, 0) + 1


async def one(kind):
    p = random.choice(PROMPTS)
    m = [{"role": "user", "content": p}]
    mt = random.choice([8, 32, 64])
    try:
        if kind == "plain":
            r = await cli.chat.completions.create(
                model="smollm2", messages=m, max_tokens=mt, temperature=random.choice([0, 0.7]), seed=1
            )
            assert r.choices[0].message.content is not None
        elif kind == "stream":
            s = await cli.chat.completions.create(
                model="smollm2", messages=m, max_tokens=mt, stream=True, stream_options={"include_usage": True}
            )
            async for _ in s:
                pass
        elif kind == "n2":
            r = await cli.chat.completions.create(model="smollm2", messages=m, max_tokens=mt, n=2, temperature=0.8)
            assert len(r.choices) == 2
        elif kind == "tools":
            r = await cli.chat.completions.create(
                model="smollm2",
                messages=[{"role": "user", "content": "Weather in Paris?"}],
                tools=TOOLS,
                tool_choice=random.choice(["required", "auto"]),
                max_tokens=64,
            )
        elif kind == "json":
            r = await cli.chat.completions.create(
                model="smollm2", messages=m, max_tokens=48, response_format={"type": "json_object"}
            )
        elif kind == "pred":
            r = await cli.chat.completions.create(
                model="smollm2",
                messages=m,
                max_tokens=mt,
                prediction={"type": "content", "content": "1. Red\n2. Blue\n3. Green"},
            )
        elif kind == "logprobs":
            r = await cli.chat.completions.create(
                model="smollm2", messages=m, max_tokens=mt, logprobs=True, top_logprobs=3
            )
        elif kind == "minstop":
            r = await cli.chat.completions.create(
                model="smollm2", messages=m, max_tokens=mt, extra_body={"min_tokens": 5}, stop=["\n"]
            )
        elif kind == "completion":
            r = await cli.completions.create(model="smollm2", prompt=p, max_tokens=mt, echo=random.random() < 0.5)
        elif kind == "drop":
            async with httpx.AsyncClient(timeout=60) as h:
                async with h.stream(
                    "POST",
                    BASE + "/v1/chat/completions",
                    json={"model": "smollm2", "messages": m, "max_tokens": 64, "stream": True},
                ) as resp:
                    n = 0
                    async for _ in resp.aiter_lines():
                        n += 1
                        if n > 4:
                            break
        elif kind == "bad":
            body = random.choice(
                [
                    {"model": "smollm2", "messages": []},
                    {"model": "smollm2", "messages": m, "max_tokens": -1},
                    {"model": "smollm2", "messages": m, "temperature": "hot"},
                    {"model": "nope", "messages": m},
                    {"model": "smollm2", "messages": m, "tools": [{"type": "function"}]},
                    {"model": "smollm2", "messages": m, "response_format": {"type": "json_schema"}},
                ]
            )
            async with httpx.AsyncClient(timeout=60) as h:
                r = await h.post(BASE + "/v1/chat/completions", json=body)
                assert 400 <= r.status_code < 500 and "error" in r.json(), (r.status_code, r.text)
        count(kind + ":ok")
    except (BadRequestError, APIStatusError) as e:
        count(kind + f":http{e.status_code}")
        if e.status_code >= 500:
            print(kind, e)
    except Exception as e:
        count(kind + ":EXC")
        print(kind, repr(e)[:300])


async def user(deadline):
    kinds = ["plain", "stream", "n2", "tools", "json", "pred", "logprobs", "minstop", "completion", "drop", "bad"]
    while time.time() < deadline:
        await one(random.choice(kinds))


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


async def sample_rss(pid: int, deadline: float, samples: list) -> None:
    while time.time() < deadline:
        samples.append((round(time.time()), rss_kib(pid)))
        await asyncio.sleep(10)


async def main():
    global BASE, cli
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=BASE)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--users", type=int, default=12)
    ap.add_argument("--pid", type=int, default=0, help="the server's pid: sample its RSS")
    args = ap.parse_args()
    BASE = args.url.rstrip("/")
    cli = AsyncOpenAI(base_url=BASE + "/v1", api_key=os.environ.get("OPENAI_API_KEY", "x"), max_retries=0, timeout=300)
    dur = args.seconds
    rss: list = []
    ref = await cli.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Name three colors."}], max_tokens=32, temperature=0
    )
    deadline = time.time() + dur
    await asyncio.gather(
        *[user(deadline) for _ in range(args.users)], *([sample_rss(args.pid, deadline, rss)] if args.pid else [])
    )
    await asyncio.sleep(2)
    again = await cli.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Name three colors."}], max_tokens=32, temperature=0
    )
    print("same greedy before/after:", ref.choices[0].message.content == again.choices[0].message.content)
    print(json.dumps(dict(sorted(stats.items())), indent=0))
    if rss:
        print("RSS MiB (time, value):", [(t - rss[0][0], round(v / 1024)) for t, v in rss])
    failed = [k for k in stats if not k.endswith(":ok")]
    print("FAILED kinds:" if failed else "every request got what it should", failed or "")


if __name__ == "__main__":
    asyncio.run(main())
