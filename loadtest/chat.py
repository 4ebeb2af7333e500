"""Streaming chat load test for any OpenAI-compatible endpoint (the moa-serve gateway, SGLang, ...).

    locust -f loadtest/chat.py --host http://127.0.0.1:8000 \
        --headless -u 8 -r 4 -t 20s --csv results/loadtest/chat --only-summary

With stream=True locust's own response time is only the time to the response headers, so each request
also reports, as request_type "METRIC" rows (response_time column = the value):
  ttft_ms         time to the first content token
  itl_ms          each gap between consecutive content chunks
  e2e_ms          request start to the end of the stream ([DONE])
  output_tokens   completion tokens (usage.completion_tokens when the server sends it, else content chunks)
  cached_tokens   prompt tokens the server took from its prefix cache (usage.prompt_tokens_details), when sent
  ttft_ms (turn 1), ttft_ms (turn 2+)   the multiturn workload's TTFT of first turns, and of later ones

Environment:
  MOA_LOADTEST_HOST         base URL when --host is not given (default http://127.0.0.1:8000)
  MOA_LOADTEST_MODEL        model name (default: the first id from GET /v1/models)
  MOA_LOADTEST_API_KEY      sent as "Authorization: Bearer ..." when set
  MOA_LOADTEST_MAX_TOKENS   default 128
  MOA_LOADTEST_TEMPERATURE  default 0.0
  MOA_LOADTEST_PROMPTS      a .jsonl file ("turns"[0] or "prompt" of each line), a directory of them, or a
                            text file with one prompt per line. Default: ../shared/data/eval/*.jsonl when
                            that directory exists, else a small built-in list.
  MOA_LOADTEST_THINK_TIME   max seconds a user waits between requests (uniform, default 0: closed loop)
  MOA_LOADTEST_MIX          workloads and their weights, e.g. "chat:8,tools:1,prediction:1" (default "chat:1"):
                              chat        a prompt from MOA_LOADTEST_PROMPTS
                              tools       a question with a weather and a search function, tool_choice
                                          "required" (a tool call streamed back; finish_reason tool_calls;
                                          max_tokens at least TOOL_MAX_TOKENS, room for a whole call; a
                                          reply cut at max_tokens is the client's limit, not a failure)
                              prediction  a prompt this user asked before, asked again with its last answer
                                          as the predicted output (OpenAI `prediction`: "regenerate")
                              generate    "Question: <prompt>\nAnswer:" as raw text to SGLang's native POST
                                          /generate (stream; the text so far in each event; min_new_tokens 4)
                              multiturn   one conversation per user, MOA_LOADTEST_TURNS turns long: each turn
                                          sends the history (the system prompt, earlier questions and the
                                          server's own answers) and a new question from MOA_LOADTEST_PROMPTS,
                                          so a server with a prefix cache prefills only the new message
                            Each is its own request name ("/v1/chat/completions (tools)", ...) with the same
                            METRIC rows; a tool call's arrival counts as its first token.
  MOA_LOADTEST_ORDER        random (default: each request's workload drawn by the mix's weights) | cycle (each user
                            goes through the mix in order, each workload its weight's times in a row, user i
                            starting at place i: with as many users as the mix has places, every workload is
                            sent in the users' first requests however few requests the run has time for)
  MOA_LOADTEST_TURNS        multiturn: turns per conversation (default 4)
  MOA_LOADTEST_SYSTEM_PROMPT  multiturn: a system prompt every conversation shares (text, or a file holding it)
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

from locust import HttpUser, between, events

BUILTIN_PROMPTS = [
    "Write a haiku about speculative decoding.",
    "Explain the difference between a process and a thread in three sentences.",
    "What is 17 * 23? Show your work.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Give three tips for writing clear technical documentation.",
    "Translate 'The weather is nice today' into French, German and Spanish.",
    "Why is the sky blue? Answer for a ten-year-old.",
]
SHARED_EVAL = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "eval"


def _prompts_from_jsonl(path: Path) -> list[str]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            out.append(row["turns"][0] if "turns" in row else row["prompt"])
    return out


def load_prompts(source: str | None) -> list[str]:
    path = Path(source) if source else (SHARED_EVAL if any(SHARED_EVAL.glob("*.jsonl")) else None)
    if path is None:
        return BUILTIN_PROMPTS
    if path.is_dir():
        prompts = [p for f in sorted(path.glob("*.jsonl")) for p in _prompts_from_jsonl(f)]
    elif path.suffix == ".jsonl":
        prompts = _prompts_from_jsonl(path)
    else:
        prompts = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    return prompts


PROMPTS = load_prompts(os.environ.get("MOA_LOADTEST_PROMPTS"))
MAX_TOKENS = int(os.environ.get("MOA_LOADTEST_MAX_TOKENS", "128"))
TEMPERATURE = float(os.environ.get("MOA_LOADTEST_TEMPERATURE", "0.0"))
API_KEY = os.environ.get("MOA_LOADTEST_API_KEY", "")
THINK_TIME = float(os.environ.get("MOA_LOADTEST_THINK_TIME", "0"))
WORKLOADS = ("chat", "tools", "prediction", "generate", "multiturn")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "web_search",
            "description": "Search the web",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    },
]
TOOL_QUESTIONS = [
    "What's the weather in Paris?",
    "Is it raining in Tokyo right now?",
    "Find the population of Canada.",
    "Search for the latest Python release.",
    "How warm is it in Cairo today?",
]


def parse_mix(text: str) -> dict[str, int]:
    """ "chat:8,tools:1" -> {"chat": 8, "tools": 1}; a name without a weight weighs 1 (locust's weights are counts)."""
    mix = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, weight = part.partition(":")
        if name not in WORKLOADS:
            raise ValueError(f"MOA_LOADTEST_MIX: unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
        try:
            mix[name] = int(weight) if weight else 1
        except ValueError:
            raise ValueError(f"MOA_LOADTEST_MIX: weight of {name!r} is not a whole number: {weight!r}") from None
        if mix[name] < 0:
            raise ValueError(f"MOA_LOADTEST_MIX: weight of {name!r} is negative")
    if not any(mix.values()):
        raise ValueError(f"MOA_LOADTEST_MIX: no workload with a positive weight in {text!r}")
    return mix


MIX = parse_mix(os.environ.get("MOA_LOADTEST_MIX", "chat:1"))
TURNS = int(os.environ.get("MOA_LOADTEST_TURNS", "4"))


def system_prompt(source: str | None) -> str:
    """MOA_LOADTEST_SYSTEM_PROMPT: the text, or the contents of the file it names."""
    if not source:
        return ""
    path = Path(source)
    return path.read_text(encoding="utf-8") if len(source) < 4096 and path.is_file() else source


SYSTEM_PROMPT = system_prompt(os.environ.get("MOA_LOADTEST_SYSTEM_PROMPT"))
TOOL_MAX_TOKENS = 128  # a call is ~30-60 tokens (one cut short comes back as text)


def sse_lines(raw) -> Iterator[bytes]:
    """Lines of a streamed body as they arrive.

    NOTE: not requests' iter_lines(): on a close-delimited (not chunked) stream its fixed-size reads wait
    for the whole body, so every token "arrives" at the end. read1() returns what one receive brings,
    for chunked and close-delimited bodies alike (urllib3 decodes the chunk framing).
    """
    buf = b""
    while chunk := raw.read1(65536):
        buf += chunk
        *lines, buf = buf.split(b"\n")
        yield from lines
    if buf:
        yield buf


def fire_metric(name: str, value: float) -> None:
    events.request.fire(
        request_type="METRIC", name=name, response_time=value, response_length=0, exception=None, context={}
    )


class ChatUser(HttpUser):
    host = os.environ.get("MOA_LOADTEST_HOST", "http://127.0.0.1:8000")
    wait_time = between(0, THINK_TIME)

    def on_start(self) -> None:
        self.headers = {"Authorization": f"Bearer {API_KEY}"} if API_KEY else {}
        self.model = os.environ.get("MOA_LOADTEST_MODEL") or self._first_model()

    def _first_model(self) -> str:
        with self.client.get("/v1/models", headers=self.headers, catch_response=True) as resp:
            if resp.status_code == 200 and resp.json().get("data"):
                return resp.json()["data"][0]["id"]
            resp.failure(f"GET /v1/models: HTTP {resp.status_code}; set MOA_LOADTEST_MODEL")
            return "default"

    def chat(self) -> None:
        self._stream("chat", [{"role": "user", "content": random.choice(PROMPTS)}])

    def tools(self) -> None:
        self._stream(
            "tools",
            [{"role": "user", "content": random.choice(TOOL_QUESTIONS)}],
            tools=TOOLS,
            tool_choice="required",
            max_tokens=max(MAX_TOKENS, TOOL_MAX_TOKENS),
        )

    def prediction(self) -> None:
        """Ask a prompt again with this user's last answer to it as the prediction (the first time: no prediction)."""
        prompt = random.choice(PROMPTS[:8])  # a few prompts, so that repeats come soon
        answers = self.__dict__.setdefault("answers", {})
        extra = {"prediction": {"type": "content", "content": answers[prompt]}} if prompt in answers else {}
        text = self._stream("prediction", [{"role": "user", "content": prompt}], **extra)
        if text:
            answers[prompt] = text

    def multiturn(self) -> None:
        """The next turn of this user's conversation (its history and a new question); after TURNS turns, a new
        conversation. A failed turn starts a new one."""
        history = self.__dict__.setdefault("conversation", [])
        if len(history) >= 2 * TURNS:
            history.clear()
        question = {"role": "user", "content": random.choice(PROMPTS)}
        system = [{"role": "system", "content": SYSTEM_PROMPT}] if SYSTEM_PROMPT else []
        text = self._stream("multiturn", system + history + [question], turn=len(history) // 2 + 1)
        if text is None:
            history.clear()
        else:
            history += [question, {"role": "assistant", "content": text}]

    def generate(self) -> None:
        """SGLang's native API (the moa-serve gateway serves it too): cumulative text per event."""
        # raw text, no chat template: framed as Q/A, and min_new_tokens so an immediate EOS cannot end it empty
        body = {
            "text": f"Question: {random.choice(PROMPTS)}\nAnswer:",
            "stream": True,
            "sampling_params": {
                "max_new_tokens": MAX_TOKENS,
                "min_new_tokens": min(4, MAX_TOKENS),
                "temperature": TEMPERATURE,
            },
        }
        start = time.perf_counter()
        with self.client.post(
            "/generate", json=body, headers=self.headers, stream=True, catch_response=True, name="/generate (stream)"
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            token_times, seen, completion = [], 0, None
            try:
                for raw in sse_lines(resp.raw):
                    line = raw.decode("utf-8").rstrip("\r")
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    event = json.loads(line[5:])
                    if "error" in event:
                        raise ValueError(f"error event: {event['error'].get('message', event['error'])}")
                    if len(event.get("text") or "") > seen:
                        token_times.append(time.perf_counter())
                        seen = len(event["text"])
                    completion = event["meta_info"]["completion_tokens"]
            except (ValueError, KeyError) as exc:
                resp.failure(str(exc))
                return
            if not token_times:
                resp.failure("stream ended without text")
                return
            self._report(start, token_times, completion)

    def _stream(self, workload: str, messages: list[dict], turn: int | None = None, **extra) -> str | None:
        """One streamed chat completion; reports its METRIC rows (turn: its turn in a conversation); returns the
        content (None on failure)."""
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": MAX_TOKENS,
            "temperature": TEMPERATURE,
            "stream": True,
            "stream_options": {"include_usage": True},
            **extra,
        }
        name = "/v1/chat/completions (stream)" if workload == "chat" else f"/v1/chat/completions ({workload})"
        start = time.perf_counter()
        with self.client.post(
            "/v1/chat/completions", json=body, headers=self.headers, stream=True, catch_response=True, name=name
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return None
            try:
                token_times, usage, text, calls, finish = self._read_stream(resp)
            except (ValueError, KeyError) as exc:  # malformed SSE / JSON or an error event
                resp.failure(str(exc))
                return None
            if workload == "tools" and not calls and finish != "length":
                resp.failure(f"no tool call in the reply to tool_choice=required (finish_reason {finish})")
                return None
            if not token_times:
                resp.failure("stream ended without content")
                return None
            self._report(start, token_times, usage.get("completion_tokens"))
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            if cached is not None:
                fire_metric("cached_tokens", cached)
            if turn is not None:
                fire_metric("ttft_ms (turn 1)" if turn == 1 else "ttft_ms (turn 2+)", (token_times[0] - start) * 1000)
            return text

    @staticmethod
    def _read_stream(resp) -> tuple[list[float], dict, str, int, str | None]:
        """Arrival time of each chunk with content or tool calls, the usage if the server sent it ({} if not),
        the content, the number of tool calls and the finish_reason."""
        token_times: list[float] = []
        usage: dict = {}
        text, calls, finish = [], 0, None
        for raw in sse_lines(resp.raw):
            line = raw.decode("utf-8").rstrip("\r")
            if not line.startswith("data:"):
                continue  # blank separators, SSE comments
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                return token_times, usage, "".join(text), calls, finish
            chunk = json.loads(data)
            if "error" in chunk:
                raise ValueError(f"error event: {chunk['error'].get('message', chunk['error'])}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                if delta.get("content") or delta.get("tool_calls"):
                    token_times.append(time.perf_counter())
                text.append(delta.get("content") or "")
                calls += len(delta.get("tool_calls") or [])
                finish = choice.get("finish_reason") or finish
        raise ValueError("stream closed before data: [DONE]")

    @staticmethod
    def _report(start: float, token_times: list[float], usage_tokens: int | None) -> None:
        end = time.perf_counter()
        fire_metric("ttft_ms", (token_times[0] - start) * 1000)
        for prev, cur in zip(token_times, token_times[1:]):
            fire_metric("itl_ms", (cur - prev) * 1000)
        fire_metric("e2e_ms", (end - start) * 1000)
        fire_metric("output_tokens", usage_tokens if usage_tokens is not None else len(token_times))


ORDER = os.environ.get("MOA_LOADTEST_ORDER", "random")
if ORDER not in ("random", "cycle"):
    raise ValueError(f"MOA_LOADTEST_ORDER: {ORDER!r} is neither random nor cycle")
CYCLE = [name for name, weight in MIX.items() for _ in range(weight)]
STARTED = {"users": 0}  # users started (cycle: where the next one starts)


def next_in_cycle(user: ChatUser) -> None:
    """MOA_LOADTEST_ORDER=cycle: the user's next workload, in the mix's order from the user's own start."""
    if "place" not in user.__dict__:
        user.place = STARTED["users"]
        STARTED["users"] += 1
    getattr(user, CYCLE[user.place % len(CYCLE)])()
    user.place += 1


# the mix's workloads as locust tasks with their weights (a workload of weight 0 is left out)
if ORDER == "cycle":
    ChatUser.tasks = [next_in_cycle]
else:
    ChatUser.tasks = {getattr(ChatUser, name): weight for name, weight in MIX.items() if weight > 0}
