"""Hostile input against a real server (127.0.0.1, SmolLM2 fp32, n-gram drafter, edge API on): every route.

Every request of the table must get a 4xx in the OpenAI error shape (never a 5xx), while streams run
next to it; those streams must finish with exactly the tokens and finish_reason they produce alone.
Then the attacks on everyone, class by class (grammar work, bodies that are not UTF-8, text that is not
text, grammars that match no text, slow clients): each runs beside two greedy streams, run again and again
until it is over, which must finish with exactly their tokens alone and no gap between two events much
longer than alone, while /health answers within 1 s throughout.
A property-based fuzzer (hypothesis) then sends request bodies drawn from the schemas, with valid and
hostile values mixed: 2xx or 4xx, never 5xx. /metrics must show no request error and no fault.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx
import openai
import pytest
from helpers import slots_whole, tiny_target
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from serving.config import EngineConfig
from serving.edge.protocol import unpack
from serving.engine import Engine
from serving.gateway.app import GatewayConfig, create_app
from serving.gateway.schemas import Limits
from serving.gateway.server import ServerThread, build_edge, embedded_backend
from serving.grammar_pool import GrammarConfig
from sglang_ext.drafters import make_drafter
from sglang_ext.tree import TreeShape

MODEL, DRAFTER, EDGE_DRAFTER = "smollm2", "ngram", "moa-tli0"
CHAT, COMP, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
VOCAB = 49152
DEEP = "[" * 100_000 + "]" * 100_000  # 100k nested arrays (200 KB, under the body limit)
BODY_TIMEOUT_S = 2.0  # --body-timeout: a request's head, then its body
GRAMMAR_TIMEOUT_S = 5.0  # --grammar-timeout


@pytest.fixture(scope="module")
def server(smollm2_fp32):
    # NOTE: a chain of 3 keeps every verify forward small; greedy rows then do not depend on the batch
    engine = Engine(
        smollm2_fp32, make_drafter(DRAFTER, smollm2_fp32), EngineConfig(tree=TreeShape.chain(3), kv_slots=8192)
    )
    backend, telemetry = embedded_backend(engine, MODEL, DRAFTER, grammar=GrammarConfig(timeout_s=GRAMMAR_TIMEOUT_S))
    edge, edge_tok = build_edge(smollm2_fp32, EDGE_DRAFTER, ttl_s=600)
    config = GatewayConfig(limits=Limits(body_timeout_s=BODY_TIMEOUT_S))
    with ServerThread(create_app(backend, telemetry, config, edge=edge, edge_tokenizer=edge_tok)) as srv:
        srv.engine, srv.telemetry = engine, telemetry
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def session(http):
    """An edge session: (id, root)."""
    r = http.post("/v1/edge/sessions", json={"prompt_token_ids": [1, 2, 3], "drafter": EDGE_DRAFTER})
    assert r.status_code == 200, r.text
    head, _ = unpack(r.content)
    return head["session_id"], head["root"]


def chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **kw}


def comp(**kw):
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 4, **kw}


def gen(sp=None, **kw):
    return {"text": "Hi", "sampling_params": {"max_new_tokens": 4, **(sp or {})}, **kw}


def raw(body: dict, key: str, text: str) -> str:
    """`body` as JSON text with the value of `key` replaced by raw JSON `text` (NaN, deep nesting, huge numbers)."""
    return json.dumps({**body, key: "@@"}).replace('"@@"', text)


def deep_schema(levels: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(levels):
        s = {"type": "object", "properties": {"a": s}}
    return s


def tool(parameters) -> list:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


def call_message(arguments: str) -> list:
    return [
        {
            "role": "assistant",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}],
        }
    ]


# (name, method, path, body: dict | str | bytes | None, status, param)
HOSTILE = [
    # token ids carried by the OpenAI routes
    (
        "chat stop id past the vocab with min_tokens",
        "POST",
        CHAT,
        chat(stop_token_ids=[99999999], min_tokens=1),
        400,
        "stop_token_ids",
    ),
    ("chat stop id 10**30", "POST", CHAT, chat(stop_token_ids=[10**30]), 400, "stop_token_ids[0]"),
    ("chat stop id -5", "POST", CHAT, chat(stop_token_ids=[-5]), 400, "stop_token_ids[0]"),
    ("chat stop id == vocab", "POST", CHAT, chat(stop_token_ids=[VOCAB], min_tokens=2), 400, "stop_token_ids"),
    ("chat stop id a string", "POST", CHAT, chat(stop_token_ids=["7"]), 400, "stop_token_ids[0]"),
    ("chat 65 stop ids", "POST", CHAT, chat(stop_token_ids=list(range(65))), 400, "stop_token_ids"),
    (
        "chat streamed stop id past the vocab",
        "POST",
        CHAT,
        chat(stop_token_ids=[99999999], min_tokens=1, stream=True),
        400,
        "stop_token_ids",
    ),
    ("chat logit_bias id past the vocab", "POST", CHAT, chat(logit_bias={"99999999": 5}), 400, "logit_bias"),
    ("chat logit_bias 5000-digit id", "POST", CHAT, chat(logit_bias={"1" * 5000: 5}), 400, "logit_bias"),
    ("chat logit_bias 5000-digit id of zeros", "POST", CHAT, chat(logit_bias={"0" * 4999 + "1": 5}), 400, "logit_bias"),
    ("chat logit_bias negative id", "POST", CHAT, chat(logit_bias={"-5": 5}), 400, "logit_bias"),
    ("chat logit_bias NaN", "POST", CHAT, raw(chat(), "logit_bias", '{"5": NaN}'), 400, None),
    ("chat top_k 10**12", "POST", CHAT, chat(top_k=10**12), 400, "top_k"),
    ("chat top_k vocab + 1", "POST", CHAT, chat(top_k=VOCAB + 1), 400, "top_k"),
    ("chat temperature Infinity", "POST", CHAT, raw(chat(), "temperature", "Infinity"), 400, None),
    ("chat max_tokens 5000 digits", "POST", CHAT, raw(chat(), "max_tokens", "9" * 5000), 400, None),
    ("chat max_tokens 10**30", "POST", CHAT, chat(max_tokens=10**30), 400, "max_tokens"),
    ("chat n 10**30", "POST", CHAT, chat(n=10**30), 400, "n"),
    ("chat n 10**30 with a seed", "POST", CHAT, chat(n=10**30, seed=5), 400, "seed"),
    ("chat seed 2**64", "POST", CHAT, chat(seed=2**64), 400, "seed"),
    (
        "chat min_tokens 10**9 without max_tokens",
        "POST",
        CHAT,
        {**chat(min_tokens=10**9), "max_tokens": None},
        400,
        "min_tokens",
    ),
    ("chat top_logprobs 10**9", "POST", CHAT, chat(logprobs=True, top_logprobs=10**9), 400, "top_logprobs"),
    ("chat presence_penalty 1e308", "POST", CHAT, chat(presence_penalty=1e308), 400, "presence_penalty"),
    ("chat repetition_penalty -1", "POST", CHAT, chat(repetition_penalty=-1), 400, "repetition_penalty"),
    (
        "chat repetition_penalty 1e-92 (logits / it overflow)",
        "POST",
        CHAT,
        chat(repetition_penalty=1e-92),
        400,
        "repetition_penalty",
    ),
    # nesting
    ("chat body 100k nested arrays", "POST", CHAT, DEEP, 400, None),
    (
        "chat content 100k nested arrays",
        "POST",
        CHAT,
        raw(chat(), "messages", f'[{{"role": "user", "content": {DEEP}}}]'),
        400,
        None,
    ),
    (
        "chat json_schema 100k nested arrays",
        "POST",
        CHAT,
        raw(chat(), "response_format", f'{{"type": "json_schema", "json_schema": {{"name": "x", "schema": {DEEP}}}}}'),
        400,
        None,
    ),
    (
        "chat json_schema 200 levels",
        "POST",
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": deep_schema(200)}}),
        400,
        None,
    ),
    ("chat tool parameters 200 levels", "POST", CHAT, chat(tools=tool(deep_schema(200))), 400, None),
    (
        "chat tool call arguments 100k nested arrays",
        "POST",
        CHAT,
        chat(messages=call_message(DEEP)),
        400,
        "messages[0].tool_calls[0].function.arguments",
    ),
    (
        "chat prediction 100k nested arrays",
        "POST",
        CHAT,
        raw(chat(), "prediction", f'{{"type": "content", "content": {DEEP}}}'),
        400,
        None,
    ),
    ("chat regex nested 100k groups", "POST", CHAT, chat(regex="(" * 100_000 + "a" + ")" * 100_000), 400, "regex"),
    (
        "chat ebnf nested 100k groups",
        "POST",
        CHAT,
        chat(ebnf="root ::= " + "(" * 100_000 + '"a"' + ")" * 100_000),
        400,
        "ebnf",
    ),
    ("chat body invalid UTF-8", "POST", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),
    ("chat body a bare number", "POST", CHAT, "1" * 5000, 400, None),
    ("chat messages empty", "POST", CHAT, chat(messages=[]), 400, "messages"),
    ("chat messages not a list", "POST", CHAT, chat(messages={"role": "user"}), 400, "messages"),
    ("chat continue_final_message without assistant", "POST", CHAT, chat(continue_final_message=True), 400, "messages"),
    # completions
    ("completions prompt id 10**30", "POST", COMP, comp(prompt=[1, 2, 10**30]), 400, "prompt"),
    ("completions prompt id -1", "POST", COMP, comp(prompt=[-1]), 400, "prompt"),
    ("completions prompt id past the vocab in a batch", "POST", COMP, comp(prompt=[[1, 2], [99999999]]), 400, "prompt"),
    (
        "completions stop id past the vocab with min_tokens",
        "POST",
        COMP,
        comp(stop_token_ids=[99999999], min_tokens=1),
        400,
        "stop_token_ids",
    ),
    ("completions logprobs 10**9", "POST", COMP, comp(logprobs=10**9), 400, "logprobs"),
    (
        "completions echo scoring with a bad bias",
        "POST",
        COMP,
        comp(max_tokens=0, echo=True, logit_bias={"99999999": 1}),
        400,
        "logit_bias",
    ),
    ("completions prompt 100k nested arrays", "POST", COMP, raw(comp(), "prompt", DEEP), 400, None),
    ("completions top_k vocab + 1", "POST", COMP, comp(top_k=VOCAB + 1), 400, "top_k"),
    # SGLang's /generate
    (
        "generate min_new_tokens + stop id past the vocab",
        "POST",
        GEN,
        gen({"min_new_tokens": 1, "stop_token_ids": [99999999]}),
        400,
        "sampling_params.stop_token_ids",
    ),
    (
        "generate stop id 10**30",
        "POST",
        GEN,
        gen({"stop_token_ids": [10**30]}),
        400,
        "sampling_params.stop_token_ids[0]",
    ),
    ("generate stop id -5", "POST", GEN, gen({"stop_token_ids": [-5]}), 400, "sampling_params.stop_token_ids[0]"),
    (
        "generate input id 10**30",
        "POST",
        GEN,
        {"input_ids": [1, 10**30], "sampling_params": {"max_new_tokens": 2}},
        400,
        "input_ids",
    ),
    (
        "generate input id -5",
        "POST",
        GEN,
        {"input_ids": [-5], "sampling_params": {"max_new_tokens": 2}},
        400,
        "input_ids",
    ),
    (
        "generate logprob_start_len 10**9",
        "POST",
        GEN,
        gen(return_logprob=True, logprob_start_len=10**9),
        400,
        "logprob_start_len",
    ),
    ("generate top_k 10**12", "POST", GEN, gen({"top_k": 10**12}), 400, "sampling_params.top_k"),
    (
        "generate logit_bias id past the vocab",
        "POST",
        GEN,
        gen({"logit_bias": {"99999999": 1}}),
        400,
        "sampling_params.logit_bias",
    ),
    ("generate n 10**30", "POST", GEN, gen({"n": 10**30}), 400, "sampling_params.n"),
    ("generate max_new_tokens -1", "POST", GEN, gen({"max_new_tokens": -1}), 400, "sampling_params.max_new_tokens"),
    (
        "generate top_logprobs_num 10**30",
        "POST",
        GEN,
        gen(return_logprob=True, top_logprobs_num=10**30),
        400,
        "top_logprobs_num",
    ),
    ("generate body 100k nested arrays", "POST", GEN, DEEP, 400, None),
    ("generate text 100k nested arrays", "POST", GEN, raw(gen(), "text", DEEP), 400, None),
    (
        "generate json_schema 100k nested arrays",
        "POST",
        GEN,
        gen({"json_schema": DEEP}),
        400,
        "sampling_params.json_schema",
    ),
    (
        "generate streamed stop id past the vocab",
        "POST",
        GEN,
        gen({"min_new_tokens": 1, "stop_token_ids": [99999999]}, stream=True),
        400,
        "sampling_params.stop_token_ids",
    ),
    (
        "generate 100 sampling_params for 1 prompt",
        "POST",
        GEN,
        {"text": "Hi", "sampling_params": [{}] * 100},
        400,
        "sampling_params",
    ),
    # tokenize / detokenize
    ("tokenize prompt 100k nested arrays", "POST", "/tokenize", raw({}, "prompt", DEEP), 400, None),
    (
        "tokenize messages 100k nested arrays",
        "POST",
        "/tokenize",
        raw({}, "messages", f'[{{"role": "user", "content": {DEEP}}}]'),
        400,
        None,
    ),
    ("tokenize 1000 prompts", "POST", "/tokenize", {"prompt": ["a"] * 1000}, 400, "prompt"),
    (
        "tokenize tool parameters 200 levels",
        "POST",
        "/v1/tokenize",
        {"messages": [{"role": "user", "content": "x"}], "tools": tool(deep_schema(200))},
        400,
        None,
    ),
    ("tokenize NaN", "POST", "/v1/tokenize", raw({}, "prompt", "NaN"), 400, None),
    ("detokenize id 10**30", "POST", "/detokenize", {"tokens": [10**30]}, 400, "tokens"),
    ("detokenize id -5", "POST", "/detokenize", {"tokens": [-5]}, 400, "tokens"),
    ("detokenize id past the vocab in a batch", "POST", "/detokenize", {"tokens": [[1], [99999999]]}, 400, "tokens"),
    ("detokenize 100k nested arrays", "POST", "/v1/detokenize", raw({}, "tokens", DEEP), 400, None),
    # the edge API
    (
        "edge prompt id 10**30",
        "POST",
        "/v1/edge/sessions",
        {"prompt_token_ids": [1, 10**30], "drafter": EDGE_DRAFTER},
        400,
        "prompt_token_ids",
    ),
    (
        "edge prompt id -5",
        "POST",
        "/v1/edge/sessions",
        {"prompt_token_ids": [-5], "drafter": EDGE_DRAFTER},
        400,
        "prompt_token_ids",
    ),
    ("edge body 100k nested arrays", "POST", "/v1/edge/sessions", DEEP, 400, None),
    (
        "edge messages without roles",
        "POST",
        "/v1/edge/sessions",
        {"messages": [{"role": 5, "content": "x"}], "drafter": EDGE_DRAFTER},
        400,
        "messages",
    ),
    ("edge drafter a number", "POST", "/v1/edge/sessions", {"prompt_token_ids": [1], "drafter": 5}, 400, "drafter"),
    (
        "edge verify parent 10**30",
        "POST",
        "/v1/edge/sessions/{sid}/verify",
        {"seq_len": 3, "tokens": ["{root}", 5], "parents": [-1, 10**30]},
        400,
        "parents",
    ),
    (
        "edge verify token 10**30",
        "POST",
        "/v1/edge/sessions/{sid}/verify",
        {"seq_len": 3, "tokens": ["{root}", 10**30], "parents": [-1, 0]},
        400,
        "tokens",
    ),
    (
        "edge verify token -5",
        "POST",
        "/v1/edge/sessions/{sid}/verify",
        {"seq_len": 3, "tokens": ["{root}", -5], "parents": [-1, 0]},
        400,
        "tokens",
    ),
    (
        "edge verify seq_len 10**30",
        "POST",
        "/v1/edge/sessions/{sid}/verify",
        {"seq_len": 10**30, "tokens": ["{root}"], "parents": [-1]},
        409,
        "seq_len",
    ),
    ("edge verify body 100k nested arrays", "POST", "/v1/edge/sessions/{sid}/verify", DEEP, 400, None),
    (
        "edge verify unknown session",
        "POST",
        "/v1/edge/sessions/nope/verify",
        {"seq_len": 3, "tokens": [1], "parents": [-1]},
        404,
        None,
    ),
    ("edge delete unknown session", "DELETE", "/v1/edge/sessions/nope", None, 404, None),
    # the rest
    ("unknown model card", "GET", "/v1/models/" + "x" * 5000, None, 404, "model"),
    ("models with a body", "POST", "/v1/models", DEEP, 405, None),
]


def assert_openai_error(r: httpx.Response, status: int, param) -> None:
    assert r.status_code == status, (r.status_code, r.text[:300])
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    if param is not None:
        assert body["error"]["param"] == param, body


def send(http: httpx.Client, method: str, path: str, body, session) -> httpx.Response:
    sid, root = session
    path = path.replace("{sid}", sid)
    if isinstance(body, dict):
        body = json.dumps(body).replace('"{root}"', str(root))
    return http.request(method, path, content=body, headers={"content-type": "application/json"})


STREAMS = [  # (path, body): greedy, long enough to run while the table is sent
    (
        CHAT,
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Write a short poem about the sea."}],
            "max_tokens": 40,
            "temperature": 0,
            "stream": True,
            "return_token_ids": True,
        },
    ),
    (
        CHAT,
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "List three uses of copper."}],
            "max_tokens": 40,
            "temperature": 0,
            "stream": True,
            "return_token_ids": True,
            "presence_penalty": 0.5,
            "min_tokens": 8,
        },
    ),
    (
        COMP,
        {
            "model": MODEL,
            "prompt": "The history of tea begins",
            "max_tokens": 40,
            "temperature": 0,
            "stream": True,
            "return_token_ids": True,
        },
    ),
]


def run_stream(url: str, path: str, body: dict, started: threading.Event | None = None):
    """(token ids, finish_reason, the longest wait between two content events) of one streamed request; sets
    `started` at its first content."""
    ids, finish, last, gap = None, None, None, 0.0
    with httpx.stream("POST", url + path, json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                if c.get("text") or c.get("delta", {}).get("content"):
                    now = time.monotonic()
                    gap = max(gap, now - last) if last is not None else gap
                    last = now
                    if started is not None:
                        started.set()
                ids = c.get("token_ids") or ids
                finish = c.get("finish_reason") or finish
    return ids, finish, gap


def test_hostile_table_gets_4xx_while_streams_run_unchanged(server, http, session):
    assert len(HOSTILE) >= 60
    alone = [run_stream(server.url, path, body)[:2] for path, body in STREAMS]
    results: list = [None] * len(STREAMS)
    started = [threading.Event() for _ in STREAMS]

    def worker(i: int) -> None:
        results[i] = run_stream(server.url, *STREAMS[i], started[i])[:2]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(STREAMS))]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(300), "a stream did not start"
    failures = []
    for name, method, path, body, status, param in HOSTILE:
        try:
            assert_openai_error(send(http, method, path, body, session), status, param)
        except AssertionError as e:
            failures.append(f"{name}: {e}")
    for t in threads:
        t.join(300)
    assert not failures, "\n".join(failures)
    assert results == alone, "a stream changed while hostile requests were served"
    assert all(ids and finish in ("stop", "length") for ids, finish in alone)
    check_clean(server, http)


def check_clean(server, http: httpx.Client) -> None:
    """No 5xx counted, no fault, the KV pool whole, and the server still answers."""
    text = http.get("/metrics").text
    assert 'status="error"} 0.0' in text or 'status="error"' not in text, text
    assert "moa_request_faults_total{" not in text, [ln for ln in text.splitlines() if "fault" in ln]
    r = http.post(CHAT, json=chat(temperature=0))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert slots_whole(server.engine)


# --- attacks on everyone: each class beside two greedy streams and a /health probe -----------------------
BESIDE = [STREAMS[0], STREAMS[2]]  # a chat and a completion, greedy


@pytest.fixture(scope="module")
def alone(server):
    """Each stream alone, twice: ((token ids, finish_reason), the shorter of its two longest gaps)."""
    out = []
    for path, body in BESIDE:
        runs = [run_stream(server.url, path, body) for _ in range(2)]
        assert runs[0][:2] == runs[1][:2] and runs[0][0]
        out.append((runs[0][:2], min(r[2] for r in runs)))
    return out


class Beside:
    """While the block runs: the two streams, each run again as soon as it ends (so they run for the whole
    attack), and GET /health every 50 ms, timed."""

    def __init__(self, url: str):
        self.url, self.done = url, threading.Event()
        self.runs: list[list] = [[] for _ in BESIDE]
        self.health: list[tuple[float, int]] = []
        self.errors: list[BaseException] = []

    def __enter__(self) -> Beside:
        started = [threading.Event() for _ in BESIDE]
        self.threads = [threading.Thread(target=self._stream, args=(i, e)) for i, e in enumerate(started)]
        self.threads.append(threading.Thread(target=self._probe))
        for t in self.threads:
            t.start()
        for e in started:
            assert e.wait(300), "a stream did not start"
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        for t in self.threads:
            t.join(300)

    def _stream(self, i: int, started: threading.Event) -> None:
        try:
            while True:
                self.runs[i].append(run_stream(self.url, *BESIDE[i], started))
                if self.done.is_set():
                    return
        except BaseException as e:  # noqa: BLE001 - reported by check()
            self.errors.append(e)

    def _probe(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as c:
            while not self.done.is_set():
                t = time.monotonic()
                status = c.get("/health").status_code
                self.health.append((time.monotonic() - t, status))
                time.sleep(0.05)

    def check(self, alone) -> None:
        """Every run == the stream alone; no wait between events over 2 s + 10x its longest alone (a stall of
        seconds, not the noise of a loaded machine); /health always answered, each time within 1 s."""
        assert not self.errors, self.errors
        for runs, (expected, gap_alone) in zip(self.runs, alone):
            assert runs and all(r[:2] == expected for r in runs), "a stream changed beside the attack"
            worst = max(r[2] for r in runs)
            assert worst <= 2.0 + 10 * gap_alone, f"a stream stalled {worst:.2f} s (alone at most {gap_alone:.2f} s)"
        assert self.health and {s for _, s in self.health} == {200}
        slowest = max(t for t, _ in self.health)
        assert slowest < 1.0, f"/health took {slowest:.2f} s"


def attack(http, session, table) -> list[str]:
    """Each request of a (name, method, path, body, status, param, words) table; what went wrong."""
    failures = []
    for name, method, path, body, status, param, words in table:
        try:
            r = send(http, method, path, body, session)
            assert_openai_error(r, status, param)
            assert re.search(words, r.json()["error"]["message"]), r.json()["error"]["message"]
        except AssertionError as e:
            failures.append(f"{name}: {e}")
    return failures


def tools_of(parameters: dict, n: int = 1) -> list:
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": parameters}} for i in range(n)]


def nested(levels: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(levels):
        s = {"type": "array", "items": s}
    return s


def enum(n: int) -> dict:
    return {"enum": [f"value{i}" for i in range(n)]}


def bomb(fields: int) -> dict:
    """Under every grammar limit (a few hundred bytes), yet minutes of compiling: long patterns."""
    return {
        "type": "object",
        "properties": {f"k{i}": {"type": "string", "pattern": "[a-z]{3000}"} for i in range(fields)},
    }


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


TOO_COMPLEX = "this server compiles grammars of at most"
BUDGET = f"compile budget of {GRAMMAR_TIMEOUT_S:g} s"
GRAMMAR_WORK = [
    # (tools of deep schemas were converted on the event loop: the whole server froze 10-19 s)
    (
        "tools nested 100 levels",
        "POST",
        CHAT,
        chat(tools=tools_of(nested(100), 2)),
        400,
        "tools[0].function.parameters",
        "101 levels of nesting",
    ),
    (
        "tools of 200 enum values each",
        "POST",
        CHAT,
        chat(tools=tools_of({"enum": list(range(200))}, 6)),
        400,
        "tools",
        "1200 enum",
    ),
    (
        "json_schema enum of 25,000 values",
        "POST",
        CHAT,
        chat(response_format=json_schema(enum(25_000))),
        400,
        "response_format",
        "25000 enum",
    ),
    (
        "json_schema enum of 40,000 values, streamed",
        "POST",
        CHAT,
        chat(response_format=json_schema(enum(40_000)), stream=True),
        400,
        "response_format",
        "40000 enum",
    ),
    (
        "generate json_schema enum of 40,000 values",
        "POST",
        GEN,
        gen({"json_schema": json.dumps(enum(40_000))}),
        400,
        "sampling_params.json_schema",
        "40000 enum",
    ),
    (
        "regex of 5,000 alternatives",
        "POST",
        COMP,
        comp(regex="|".join(["ab"] * 5000)),
        400,
        "regex",
        "4999 alternatives",
    ),
    (
        "ebnf 100 parentheses deep",
        "POST",
        CHAT,
        chat(ebnf="root ::= " + "(" * 100 + '"a"' + ")" * 100),
        400,
        "ebnf",
        "100 levels of parentheses",
    ),
    (
        "a schema under the limits that compiles for minutes",
        "POST",
        CHAT,
        chat(response_format=json_schema(bomb(100))),
        400,
        "response_format",
        BUDGET,
    ),
    (
        "a required tool call whose schema compiles for minutes",
        "POST",
        CHAT,
        chat(tools=tools_of(bomb(101)), tool_choice="required"),
        400,
        "tools",
        BUDGET,
    ),
]


def grammar_work(http) -> dict[str, float]:
    text = http.get("/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r'moa_grammar_work_total\{.*result="(\w+)"\} ([0-9.]+)', text)}


def structured(url: str, stop: threading.Event, statuses: list[int]) -> None:
    """Structured-output requests one after another, each with a schema of its own (a compile each), until stop."""
    with httpx.Client(base_url=url, timeout=300) as c:
        while not stop.is_set():
            schema = {"type": "object", "properties": {f"k{len(statuses)}": {"type": "integer"}}}
            statuses.append(c.post(CHAT, json=chat(response_format=json_schema(schema))).status_code)


def test_grammar_work_never_holds_up_the_others(server, http, session, alone):
    """Beside the streams, legitimate structured output is served while the attacks' grammars are refused,
    over their limits or their compile budget, or abandoned by their client (each then has its worker ended)."""
    http.post(CHAT, json=chat(response_format={"type": "json_object"}))  # compile workers started (not timed)
    before, statuses, stop = grammar_work(http), [], threading.Event()
    with Beside(server.url) as beside:
        legit = threading.Thread(target=structured, args=(server.url, stop, statuses))
        legit.start()
        failures = attack(http, session, GRAMMAR_WORK)
        with pytest.raises(httpx.ReadTimeout):  # a client that leaves its compile: the worker is ended
            http.post(CHAT, json=chat(response_format=json_schema(bomb(102))), timeout=0.5)
        deadline = time.monotonic() + 60
        while grammar_work(http).get("cancelled", 0) == before.get("cancelled", 0):
            assert time.monotonic() < deadline, "the compile of a client that left was not ended"
            time.sleep(0.1)
        stop.set()
        legit.join(300)
    assert not failures, "\n".join(failures)
    assert len(statuses) >= 2 and set(statuses) == {200}, statuses
    beside.check(alone)
    after = grammar_work(http)
    assert after["timeout"] - before.get("timeout", 0) == 2 and after["cancelled"] - before.get("cancelled", 0) == 1
    check_clean(server, http)


DEEP_UTF16 = '{"model": "smollm2", "prompt": "\u0122", "x": ' + "[" * 800 + "]" * 800 + "}"
ENCODINGS = [
    (f"{route} body in {codec}, 800 levels", "POST", route, DEEP_UTF16.encode(codec), 400, None, words)
    for route in (CHAT, COMP, GEN, "/tokenize", "/detokenize", "/v1/edge/sessions")
    for codec, words in (("utf-16", "not UTF-8"), ("utf-16-le", "not valid JSON"), ("utf-32", "not UTF-8"))
] + [
    (
        "chat body in latin-1",
        "POST",
        CHAT,
        b'{"messages": [{"role": "user", "content": "caf\xe9"}]}',
        400,
        None,
        "not UTF-8",
    )
]


def test_bodies_that_are_not_utf8_get_a_400(server, http, session, alone):
    with Beside(server.url) as beside:
        failures = attack(http, session, ENCODINGS)
    assert not failures, "\n".join(failures)
    beside.check(alone)
    check_clean(server, http)


def lone(body: dict, path: str) -> str:
    """`body` as JSON text with the string at `path` (dots; [i] as .i) holding a lone surrogate escape."""
    body = json.loads(json.dumps(body))  # (a copy)
    *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]
    node = body
    for k in parents:
        node = node[k]
    node[last] = "@@"
    return json.dumps(body).replace('"@@"', '"a\\ud800b"')


CALL = [
    {
        "role": "assistant",
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"city": "\\udfff"}'}}],
    }
]
NOT_TEXT = [
    ("chat content", CHAT, lone(chat(), "messages.0.content"), "messages[0].content"),
    (
        "chat prediction",
        CHAT,
        lone(chat(prediction={"type": "content", "content": "x"}), "prediction.content"),
        "prediction.content",
    ),
    ("chat stop string", CHAT, lone(chat(stop=["x"]), "stop.0"), "stop[0]"),
    (
        "chat tool description",
        CHAT,
        lone(
            chat(tools=[{"type": "function", "function": {"name": "f", "description": "x"}}]),
            "tools.0.function.description",
        ),
        "tools[0].function.description",
    ),
    (
        "chat tool call arguments (JSON in a string)",
        CHAT,
        json.dumps(chat(messages=CALL)),
        "messages[0].tool_calls[0].function.arguments",
    ),
    (
        "chat schema property name",
        CHAT,
        json.dumps(chat(response_format=json_schema({"properties": {}}))).replace(
            '"properties": {}', '"properties": {"\\udbff": {}}'
        ),
        "response_format.json_schema.schema.properties",
    ),
    ("completions prompt", COMP, lone(comp(), "prompt"), "prompt"),
    ("completions prompt in a batch", COMP, lone(comp(prompt=["ok", "x"]), "prompt.1"), "prompt[1]"),
    ("completions prompt with echo", COMP, lone(comp(echo=True, max_tokens=0), "prompt"), "prompt"),
    ("completions stop string, streamed", COMP, lone(comp(stop="x", stream=True), "stop"), "stop"),
    ("generate text", GEN, lone(gen(), "text"), "text"),
    ("generate text in a batch", GEN, lone(gen(text=["ok", "x"]), "text.1"), "text[1]"),
    ("generate stop string", GEN, lone(gen({"stop": ["x"]}), "sampling_params.stop.0"), "sampling_params.stop[0]"),
    ("tokenize prompt", "/tokenize", lone({"prompt": "x"}, "prompt"), "prompt"),
    (
        "tokenize chat",
        "/v1/tokenize",
        lone({"messages": [{"role": "user", "content": "x"}]}, "messages.0.content"),
        "messages[0].content",
    ),
    (
        "edge messages",
        "/v1/edge/sessions",
        lone({"messages": [{"role": "user", "content": "x"}], "drafter": EDGE_DRAFTER}, "messages.0.content"),
        "messages[0].content",
    ),
]


def test_text_that_is_not_text_gets_a_400_naming_its_field(server, http, session, alone):
    table = [(name, "POST", path, body, 400, param, "lone surrogate") for name, path, body, param in NOT_TEXT]
    with Beside(server.url) as beside:
        failures = attack(http, session, table)
    assert not failures, "\n".join(failures)
    beside.check(alone)
    check_clean(server, http)


SELF = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
NO_TEXT = [
    ("json_schema $ref #", CHAT, chat(response_format=json_schema({"$ref": "#"})), "response_format"),
    (
        "json_schema that must hold itself",
        CHAT,
        chat(response_format=json_schema(SELF), stream=True),
        "response_format",
    ),
    ("ebnf root ::= root", COMP, comp(ebnf="root ::= root"), "ebnf"),
    ("ebnf with a rule that never ends", CHAT, chat(ebnf='root ::= "a" x | "b"\nx ::= "c" x'), "ebnf"),
    ("regex of an empty class", CHAT, chat(regex="[^\\x00-\\U0010FFFF]"), "regex"),
    ("generate json_schema $ref #", GEN, gen({"json_schema": '{"$ref": "#"}'}), "sampling_params.json_schema"),
    ("generate ebnf root ::= root", GEN, gen({"ebnf": "root ::= root"}, stream=True), "sampling_params.ebnf"),
    (
        "required tool call of a schema that must hold itself",
        CHAT,
        chat(tools=tools_of(SELF), tool_choice="required"),
        "tools[0].function.parameters",
    ),
    ("tools under auto", CHAT, chat(tools=tools_of(SELF)), "tools[0].function.parameters"),
]


def test_a_grammar_that_matches_no_text_is_the_clients_400(server, http, session, alone):
    table = [(name, "POST", path, body, 400, param, "matches no text") for name, path, body, param in NO_TEXT]
    with Beside(server.url) as beside:
        failures = attack(http, session, table)
    assert not failures, "\n".join(failures)
    beside.check(alone)
    check_clean(server, http)  # no fault counted: moa_request_faults_total is the server's faults only


def stalled(url: str, head: bytes) -> tuple[float, bytes]:
    """Send `head` (part of a request) and nothing more: (seconds until the server closed, what it sent)."""
    host, port = url.removeprefix("http://").split(":")
    t = time.monotonic()  # (before the connection: the server's deadline starts after it)
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(head)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return time.monotonic() - t, got


SLOW_CLIENTS = {
    "body": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: 1000\r\n\r\n" + b'{"model": "smollm2"',
    "head": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le",
    "nothing": b"",
}


def test_stalled_uploads_are_answered_or_cut(server, http, alone):
    results: dict[str, list] = {kind: [] for kind in SLOW_CLIENTS}

    def client(kind: str) -> None:
        results[kind].append(stalled(server.url, SLOW_CLIENTS[kind]))

    with Beside(server.url) as beside:
        threads = [threading.Thread(target=client, args=(k,)) for k in SLOW_CLIENTS for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    beside.check(alone)
    for seconds, got in results["body"]:  # a 408 in the OpenAI shape, then the connection closed
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower(), got[:300]
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert BODY_TIMEOUT_S <= seconds < 60
    for kind in ("head", "nothing"):  # closed without an answer
        assert [got for _, got in results[kind]] == [b""] * 6
        assert all(BODY_TIMEOUT_S <= seconds < 60 for seconds, _ in results[kind])
    check_clean(server, http)


def test_connections_beyond_the_cap_get_a_503_until_some_close():
    """uvicorn's cap (limit_concurrency): its own plain-text 503, and the connection closed."""
    engine = Engine(tiny_target(), None)
    backend, telemetry = embedded_backend(engine, "tiny", "none")
    config = GatewayConfig(limits=Limits(max_connections=8, body_timeout_s=300))
    with ServerThread(create_app(backend, telemetry, config)) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        held = [socket.create_connection((host, int(port)), timeout=60) for _ in range(8)]
        try:
            while len(srv.server.server_state.connections) < 8:  # accepted by the server
                time.sleep(0.01)
            r = httpx.get(srv.url + "/health", timeout=60)
            assert (r.status_code, r.text) == (503, "Service Unavailable")
        finally:
            for s in held:
                s.close()
        deadline = time.monotonic() + 60
        while len(srv.server.server_state.connections) > 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert httpx.get(srv.url + "/health", timeout=60).status_code == 200


# --- property-based: bodies drawn from the schemas, hostile values mixed with valid ones ----------------
HUGE = st.sampled_from([-(10**30), -1, 0, 1, VOCAB - 1, VOCAB, 2**31, 2**63, 10**30])
INTS = st.one_of(st.integers(-3, 8), HUGE)
HOSTILE_VALUES = st.one_of(
    INTS,
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.none(),
    st.text(max_size=8),
    st.lists(INTS, max_size=4),
    st.dictionaries(st.text(max_size=4), INTS, max_size=2),
)
TOKEN_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4)
VALID = {  # values the OpenAI routes accept (some combinations still are a 400: min_tokens > max_tokens, ...)
    "max_tokens": st.integers(1, 3),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 50),
    "n": st.integers(1, 2),
    "seed": st.integers(0, 2**63 - 2),
    "stop_token_ids": TOKEN_IDS,
    "min_tokens": st.integers(0, 3),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=2),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
}
NATIVE = {
    "max_new_tokens": st.integers(0, 3),
    "min_new_tokens": st.integers(0, 2),
    "stop_token_ids": TOKEN_IDS,
    "top_k": st.integers(-1, 50),
    "temperature": st.floats(0, 2),
    "n": st.integers(1, 2),
    "sampling_seed": st.integers(0, 2**32),
    "json_schema": st.just('{"type": "object"}'),
    "regex": st.just("[a-z]+"),
}


def mixed(valid: dict):
    """A dict of valid values for some fields, with at most two fields (named or not) given hostile values."""
    names = sorted(valid) + ["logprob_start_len", "top_logprobs", "logprobs", "echo", "best_of"]
    return st.builds(
        lambda ok, bad: {**ok, **bad},
        st.fixed_dictionaries({}, optional=valid),
        st.dictionaries(st.sampled_from(names), HOSTILE_VALUES, max_size=2) | st.just({}),
    )


@st.composite
def requests(draw):
    route = draw(st.sampled_from([CHAT, COMP, GEN, "/tokenize", "/detokenize"]))
    if route == GEN:
        prompt = draw(
            st.one_of(
                st.just({"text": "Hi"}),
                st.builds(lambda ids: {"input_ids": ids}, TOKEN_IDS | st.lists(INTS, max_size=3)),
            )
        )
        extra = draw(
            st.fixed_dictionaries(
                {}, optional={"return_logprob": st.booleans(), "logprob_start_len": INTS, "top_logprobs_num": INTS}
            )
        )
        return route, {**prompt, "sampling_params": {"max_new_tokens": 2, **draw(mixed(NATIVE))}, **extra}
    if route == "/detokenize":
        return route, {"tokens": draw(TOKEN_IDS | HOSTILE_VALUES)}
    if route == "/tokenize":
        return route, {"prompt": draw(st.text(max_size=20) | HOSTILE_VALUES)}
    prompt = (
        {"messages": [{"role": "user", "content": "Hi"}]}
        if route == CHAT
        else {"prompt": draw(st.just("Hi") | TOKEN_IDS)}
    )
    return route, {"model": MODEL, **prompt, "max_tokens": 2, **draw(mixed(VALID))}


@settings(max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(req=requests())
def test_fuzzed_requests_never_get_a_5xx(server, http, req):
    route, body = req
    r = http.post(route, json=body)
    event(f"{route} {r.status_code}")  # (the mix: pytest --hypothesis-show-statistics)
    assert r.status_code < 500, (route, body, r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert_openai_error(r, r.status_code, None)


def test_after_fuzzing_no_fault_and_the_server_still_serves(server, http):
    check_clean(server, http)
    # a temperature whose logits / temperature would overflow decodes greedily
    tiny_t, greedy = (http.post(CHAT, json=chat(temperature=t, max_tokens=8)) for t in (1e-300, 0))
    assert (
        tiny_t.status_code == 200 and tiny_t.json()["choices"][0]["message"] == greedy.json()["choices"][0]["message"]
    )
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=4,
            extra_body={"stop_token_ids": [99999999], "min_tokens": 1},
        )
    assert e.value.body["param"] == "stop_token_ids"
