"""The upstream (SGLang) backend against a small OpenAI-API server on 127.0.0.1 started by the test.

Real SGLang cannot run on this CPU-only machine, so the upstream here is a FastAPI app that speaks the
OpenAI streaming API the way SGLang 0.5.23 does when asked for `return_spec_tokens_details`: content
chunks, a finish chunk, a `choices: []` chunk carrying `sglext.spec_tokens_details`, the usage chunk,
`data: [DONE]`; errors as SGLang's flat `{"object": "error", "message", "type", "param", "code": 400}`.
"""

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from helpers import AdmissionLog, flood, wait_for
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from serving.backends.base import Admission
from serving.backends.sglang import SGLangBackend, UpstreamConfig
from serving.backends.telemetry import Telemetry
from serving.gateway.app import GatewayConfig, create_app
from serving.gateway.auth import APIKeys
from serving.gateway.server import DrainingServer, ServerThread
from serving.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
SPEC = {
    "spec_accept_rate": 0.5,
    "spec_accept_length": 2.5,
    "spec_num_correct_drafts": 6,
    "spec_num_proposed_drafts": 12,
    "spec_verify_ct": 4,
    "spec_correct_drafts_histogram": [1, 1, 1, 1],
}


PING_CALL = 'On it. <tool|_call>\n{"name": "pi|ng", "arguments": {}}|\n</tool_call|>'


class FakeSGLang:
    """Records requests; streams `max_tokens` words (seed picks the first word)."""

    def __init__(self):
        self.requests: list[dict] = []
        self.disconnects = 0
        self.flushes = 0
        self.healthy = True
        self.gate = threading.Event()  # prompt "gated": streams once the test sets it
        self.gate.set()
        app = self.app = FastAPI()

        @app.get("/health")
        async def health():
            return JSONResponse({}, status_code=200 if self.healthy else 503)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "upstream-model", "object": "model"}]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self.generate(await request.json(), chat=True)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self.generate(await request.json(), chat=False)

        @app.post("/flush_cache")
        async def flush_cache():  # (SGLang's answer when it flushed)
            self.flushes += 1
            return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details.\n")

    async def generate(self, body: dict, chat: bool):
        self.requests.append(body)
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if prompt == "fail400":
            return JSONResponse(
                {
                    "object": "error",
                    "message": "bad thing upstream",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                },
                status_code=400,
            )
        if prompt == "fail500":
            return JSONResponse(
                {
                    "object": "error",
                    "message": "upstream exploded",
                    "type": "InternalServerError",
                    "param": None,
                    "code": 500,
                },
                status_code=500,
            )
        assert (
            body["stream"] is True
            and body["stream_options"] == {"include_usage": True}
            and body["return_spec_tokens_details"] is True
        )
        n_tok = body.get("max_tokens", 4)
        first = (body.get("seed") or 0) % len(WORDS)
        words = [WORDS[(first + i) % len(WORDS)] for i in range(n_tok)]
        finish = "length"
        if prompt == "call ping":  # a model that calls a tool, in pieces that split the tags
            words, finish = [p.strip(" ") for p in PING_CALL.split("|")], "stop"
        slow = prompt == "slow"
        if prompt == "garbled":  # an upstream that answers 200 and then a stream nobody can read
            return StreamingResponse(
                iter(
                    [
                        'data: {"choices": [{"index": 0, "text": "ok", "finish_reason": null}]}\n\n',
                        "data: {not json\n\n",
                    ]
                ),
                media_type="text/event-stream",
            )

        def chunk(**kw):
            return (
                "data: "
                + json.dumps(
                    {
                        "id": "x",
                        "object": "chat.completion.chunk" if chat else "text_completion",
                        "created": 1,
                        "model": body["model"],
                        **kw,
                    }
                )
                + "\n\n"
            )

        def choice(text=None, finish=None, i=0):
            lp = None
            if (
                text is not None and body.get("logprobs") is not None
            ):  # word i has logprob -(i + 1) / 10, as its only alternative
                v = -(i + 1) / 10
                if chat:
                    top = [{"token": text, "logprob": v, "bytes": list(text.encode())}][: body.get("top_logprobs") or 0]
                    lp = {"content": [{"token": text, "logprob": v, "bytes": list(text.encode()), "top_logprobs": top}]}
                else:
                    lp = {"tokens": [text], "token_logprobs": [v], "top_logprobs": [{text: v}], "text_offset": [0]}
            if chat:
                return {
                    "index": 0,
                    "delta": {"content": text} if text is not None else {},
                    "finish_reason": finish,
                    "logprobs": lp,
                }
            return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": lp}

        async def events():
            try:
                while prompt == "gated" and not self.gate.is_set():
                    await asyncio.sleep(0.01)
                if chat:
                    yield chunk(
                        choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
                    )
                for i, w in enumerate(words):
                    if slow:
                        await asyncio.sleep(0.05)
                    if prompt == "hang" and i == 1:  # one word, then nothing until the gateway goes away
                        await asyncio.sleep(3600)
                    yield chunk(choices=[choice(w if i == 0 or finish == "stop" else " " + w, i=i)])
                yield chunk(choices=[choice(finish=finish)])
                yield chunk(choices=[], sglext={"spec_tokens_details": SPEC})
                usage = {"prompt_tokens": 7, "completion_tokens": n_tok, "total_tokens": 7 + n_tok}
                yield chunk(choices=[], usage={**usage, "prompt_tokens_details": {"cached_tokens": 3}})
                yield "data: [DONE]\n\n"
            except asyncio.CancelledError:
                self.disconnects += 1
                raise

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def upstream():
    fake = FakeSGLang()
    with ServerThread(fake.app) as srv:
        fake.url = srv.url
        yield fake


class StepClock:
    """A clock that moves only when a test moves it (the readiness cache's TTL without sleeping)."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def gateway(url: str, clock=time.monotonic, keys: APIKeys | None = None, admission: Admission | None = None, **cfg):
    metrics = Metrics()
    telemetry = Telemetry(metrics, "moa", "sglang")
    backend = SGLangBackend(UpstreamConfig(url, **cfg), ["llama-8b"], "moa", telemetry, admission, clock=clock)
    return ServerThread(create_app(backend, telemetry, GatewayConfig(api_keys=keys))), telemetry


@pytest.fixture(scope="module")
def gw(upstream):
    clock = StepClock()
    srv, telemetry = gateway(upstream.url, clock=clock)
    with srv:
        srv.telemetry, srv.clock = telemetry, clock
        yield srv


def expected(n: int, seed: int = 0) -> str:
    return " ".join(WORDS[(seed + i) % len(WORDS)] for i in range(n))


def test_chat_through_upstream(gw, upstream):
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="llama-8b",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0.5,
        top_p=0.9,
        seed=3,
        stop=["zzz"],
    )
    body = raw.http_response.json()
    out = ChatCompletion.model_validate(body)
    assert out.choices[0].message.content == expected(5, 3) and out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == 7 and out.usage.completion_tokens == 5
    assert (
        body["meta_info"]["spec_verify_ct"] == 4
        and body["meta_info"]["spec_draft_tokens"] == 12
        and body["meta_info"]["spec_accepted_tokens"] == 6
    )
    sent = upstream.requests[-1]
    assert (
        sent["model"] == "upstream-model"
        and sent["temperature"] == 0.5
        and sent["top_p"] == 0.9
        and sent["stop"] == ["zzz"]
        and "n" not in sent
    )

    chunks = list(
        client.chat.completions.create(
            model="llama-8b",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            n=2,
            seed=1,
        )
    )
    for ch in chunks:
        ChatCompletionChunk.model_validate(ch.model_dump())
    texts = {0: "", 1: ""}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {0: expected(4, 1), 1: expected(4, 2)}  # n=2 -> two upstream requests with seed, seed + 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8 and chunks[-1].usage.prompt_tokens == 7
    assert [r.get("seed") for r in upstream.requests[-2:]] in ([1, 2], [2, 1])

    comp = client.completions.create(model="llama-8b", prompt="once", max_tokens=3)
    assert comp.choices[0].text == expected(3) and upstream.requests[-1]["prompt"] == "once"


def test_tenant_goes_upstream_as_cache_salt_and_flush_cache_is_the_upstreams(gw, upstream):
    """SGLang keys its radix cache by cache_salt: a request's tenant (its cache_salt, with the API key when
    keys are configured) goes upstream as one, so tenants share no cached prefix there either; the upstream's
    cached tokens come back in usage and the prefix cache counters."""
    from serving.gateway.auth import tenant_key

    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    out = client.chat.completions.create(model="llama-8b", messages=messages, max_tokens=2)
    assert "cache_salt" not in upstream.requests[-1] and out.usage.prompt_tokens_details.cached_tokens == 3
    client.completions.create(model="llama-8b", prompt="hi", max_tokens=2, extra_body={"cache_salt": "s1"})
    assert upstream.requests[-1]["cache_salt"] == tenant_key("", "s1") != "s1"  # a digest, not the salt itself
    hits = gw.telemetry._prefix_hit._value.get()
    assert hits >= 6 and gw.telemetry._prefix_query._value.get() >= 14
    flushes = upstream.flushes
    r = httpx.post(gw.url + "/flush_cache")
    assert r.status_code == 200 and r.json()["success"] and "Cache flushed" in r.json()["message"]
    assert upstream.flushes == flushes + 1


def test_logprobs_pass_through_from_upstream(gw, upstream):
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(
        model="llama-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=3, logprobs=True, top_logprobs=1
    )
    assert upstream.requests[-1]["logprobs"] is True and upstream.requests[-1]["top_logprobs"] == 1
    content = out.choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in content] == [("alpha", -0.1), (" beta", -0.2), (" gamma", -0.3)]
    assert [[t.token for t in e.top_logprobs] for e in content] == [["alpha"], [" beta"], [" gamma"]]
    streamed = [
        e.token
        for ch in client.chat.completions.create(
            model="llama-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=3, logprobs=True, stream=True
        )
        for c in ch.choices
        if c.logprobs
        for e in c.logprobs.content or ()
    ]
    assert streamed == ["alpha", " beta", " gamma"]
    comp = client.completions.create(model="llama-8b", prompt="hi", max_tokens=2, logprobs=1)
    assert upstream.requests[-1]["logprobs"] == 1
    lp = comp.choices[0].logprobs
    assert (
        lp.tokens == ["alpha", " beta"]
        and lp.token_logprobs == [-0.1, -0.2]
        and lp.top_logprobs == [{"alpha": -0.1}, {" beta": -0.2}]
        and lp.text_offset == [0, 5]
    )
    assert (
        client.chat.completions.create(model="llama-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        .choices[0]
        .logprobs
        is None
    )
    assert "logprobs" not in upstream.requests[-1] and "echo" not in upstream.requests[-1]
    client.completions.create(model="llama-8b", prompt="hi", max_tokens=2, echo=True)
    assert upstream.requests[-1]["echo"] is True


def test_penalties_and_logit_bias_forwarded(gw, upstream):
    """Upstream SGLang applies them itself: they go through as given, and are left out when off."""
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    client.chat.completions.create(
        model="llama-8b",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        logit_bias={"7": -100, "9": 2.5},
        extra_body={"repetition_penalty": 1.1, "min_tokens": 2},
    )
    sent = upstream.requests[-1]
    assert sent["min_tokens"] == 2
    assert (sent["presence_penalty"], sent["frequency_penalty"], sent["repetition_penalty"]) == (0.5, -0.25, 1.1)
    assert sent["logit_bias"] == {"7": -100.0, "9": 2.5}
    client.completions.create(model="llama-8b", prompt="hi", max_tokens=2)
    assert not {
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "response_format",
        "regex",
        "ebnf",
        "min_tokens",
    } & set(upstream.requests[-1])


def test_structured_output_forwarded(gw, upstream):
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = dict(model="llama-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    client.chat.completions.create(
        **chat, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    )
    assert upstream.requests[-1]["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "response", "schema": schema},
    }
    client.chat.completions.create(**chat, response_format={"type": "json_object"})
    assert upstream.requests[-1]["response_format"] == {"type": "json_object"}
    client.completions.create(model="llama-8b", prompt="hi", max_tokens=2, extra_body={"regex": "[0-9]+"})
    assert upstream.requests[-1]["regex"] == "[0-9]+" and "response_format" not in upstream.requests[-1]
    client.chat.completions.create(**chat, extra_body={"ebnf": 'root ::= "a"'})
    assert upstream.requests[-1]["ebnf"] == 'root ::= "a"'


def test_tool_calls_through_upstream(gw, upstream):
    """The gateway renders tools into plain messages (and a grammar when a call is required) for any
    upstream model, and reads the calls out of the upstream's text."""
    from serving.api.tools import parse_tools, render_messages

    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    tools = [{"type": "function", "function": {"name": "ping", "description": "Check the link"}}]
    history = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "ping", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "pong"},
        {"role": "user", "content": "call ping"},
    ]
    out = client.chat.completions.create(model="llama-8b", messages=history, tools=tools, max_tokens=20)
    sent = upstream.requests[-1]
    expected_messages = render_messages(
        [
            history[0],
            {"role": "assistant", "content": "", "tool_calls": [{"name": "ping", "arguments": {}}]},
            {"role": "tool", "content": "pong"},
            history[-1],
        ],
        parse_tools(tools, None, None),
    )
    assert sent["messages"] == expected_messages and "tools" not in sent and "ebnf" not in sent
    c = out.choices[0]
    assert (c.message.content, c.finish_reason) == ("On it. ", "tool_calls")
    assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls] == [("ping", "{}")]
    stream = client.chat.completions.create(model="llama-8b", messages=history, tools=tools, max_tokens=20, stream=True)
    chunks = [ch.choices[0] for ch in stream if ch.choices]
    assert "".join(ch.delta.content or "" for ch in chunks) == "On it. " and chunks[-1].finish_reason == "tool_calls"
    assert [t.function.name for ch in chunks for t in ch.delta.tool_calls or ()] == ["ping"]
    client.chat.completions.create(
        model="llama-8b",
        messages=[*history[:1], {"role": "assistant", "content": "Sure"}],
        max_tokens=2,
        extra_body={"continue_final_message": True},
    )
    assert upstream.requests[-1]["continue_final_message"] is True
    client.chat.completions.create(
        model="llama-8b", messages=history[:1], tools=tools, tool_choice="required", max_tokens=2
    )
    assert "call_json" in upstream.requests[-1]["ebnf"] and upstream.requests[-1]["messages"][0]["role"] == "system"


def test_tokenize_and_generate_are_the_upstreams(gw):
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        for path, body in (
            ("/tokenize", {"prompt": "hi"}),
            ("/detokenize", {"tokens": [1]}),
            ("/generate", {"text": "hi"}),
        ):
            r = c.post(path, json=body)
            assert r.status_code == 400 and "upstream" in r.json()["error"]["message"]


def test_upstream_errors_and_readiness(gw, upstream):
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        r = c.post(
            "/v1/chat/completions", json={"model": "llama-8b", "messages": [{"role": "user", "content": "fail400"}]}
        )
        assert r.status_code == 400 and r.json()["error"] == {
            "message": "bad thing upstream",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
        r = c.post(
            "/v1/chat/completions", json={"model": "llama-8b", "messages": [{"role": "user", "content": "fail500"}]}
        )
        assert (
            r.status_code == 502
            and r.json()["error"]["code"] == "upstream_error"
            and "upstream exploded" in r.json()["error"]["message"]
        )
        assert c.get("/ready").status_code == 200
        upstream.healthy = False
        assert c.get("/ready").status_code == 200  # the cached answer, within its TTL
        gw.clock.now += SGLangBackend.READY_TTL + 0.1
        try:
            assert c.get("/ready").status_code == 503
        finally:
            upstream.healthy = True
            gw.clock.now += SGLangBackend.READY_TTL + 0.1
        assert c.get("/ready").status_code == 200


def test_unreachable_upstream(tmp_path):
    srv, _ = gateway("http://127.0.0.1:9", model="m")  # port 9 (discard): nothing listens
    with srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post("/v1/chat/completions", json={"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 502 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        ready = c.get("/ready")
        assert ready.status_code == 503 and "unreachable" in ready.json()["error"]["message"]
        assert c.get("/health").status_code == 200


def test_an_unreadable_upstream_reply_fails_that_request_alone(gw, upstream):
    faults = gw.telemetry.metrics.request_faults.labels(drafter="moa", backend="sglang", reason="upstream_response")
    before = faults._value.get()
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        bad = c.post("/v1/completions", json={"model": "llama-8b", "prompt": "garbled", "max_tokens": 4})
        assert bad.status_code == 502 and bad.json()["error"]["code"] == "upstream_error"
        ok = c.post("/v1/completions", json={"model": "llama-8b", "prompt": "hi", "max_tokens": 4})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
        assert (
            'moa_request_faults_total{backend="sglang",drafter="moa",reason="upstream_response"}'
            in c.get("/metrics").text
        )
    assert faults._value.get() == before + 1


def test_client_disconnect_closes_the_upstream_request(gw, upstream):
    before = upstream.disconnects
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        body = {
            "model": "llama-8b",
            "messages": [{"role": "user", "content": "slow"}],
            "max_tokens": 200,
            "stream": True,
        }
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if '"content": "alpha"' in line:
                    break
    deadline = time.monotonic() + 10
    while upstream.disconnects == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert upstream.disconnects == before + 1


def test_sglang_metrics(gw, upstream):
    t = gw.telemetry
    v0, d0, a0, n0 = (x._value.get() for x in (t.verify_steps, t.draft_tokens, t.accepted_tokens, t.generated_tokens))
    openai.OpenAI(base_url=gw.url + "/v1", api_key="unused").chat.completions.create(
        model="llama-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=6
    )
    assert (
        t.verify_steps._value.get() - v0 == 4
        and t.draft_tokens._value.get() - d0 == 12
        and t.accepted_tokens._value.get() - a0 == 6
    )
    assert t.generated_tokens._value.get() - n0 == 6
    text = httpx.get(gw.url + "/metrics").text
    assert 'moa_verify_steps_total{backend="sglang",drafter="moa"}' in text
    assert "moa_kv_cache_capacity_tokens{" not in text  # the upstream's KV is its own business: no series, not a 0
    promtool = shutil.which("promtool") or str(ROOT / ".tools/bin/promtool")
    if Path(promtool).exists():
        check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr


def test_cli_env_selects_the_sglang_backend(upstream, tmp_path):
    """MOA_SERVE_BACKEND / MOA_SERVE_UPSTREAM configure `moa-serve serve` (no model is loaded)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MOA_SERVE_BACKEND": "sglang", "MOA_SERVE_UPSTREAM": upstream.url}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moa_serve.entrypoints.cli",
            "serve",
            "--port",
            str(port),
            "--model",
            "llama-8b",
            "--drafter",
            "moa",
            "--no-access-log",
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "log", "w"),
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        r = httpx.post(
            url + "/v1/chat/completions",
            json={"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected(2)
        assert httpx.get(url + "/ready").json()["backend"] == "sglang"
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_drain_deadline_aborts_upstream_streams_with_an_openai_error(upstream):
    """The real drain (DrainingServer.on_tick) of a gateway in front of the upstream: a stream still
    running at the deadline ends with an OpenAI-shaped 503 event and [DONE], and the upstream request is closed."""
    metrics = Metrics()
    telemetry = Telemetry(metrics, "moa", "sglang")
    backend = SGLangBackend(UpstreamConfig(upstream.url), ["llama-8b"], "moa", telemetry)
    app = create_app(backend, telemetry)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", access_log=False, timeout_graceful_shutdown=5
    )  # as `moa-serve serve` runs it
    server = DrainingServer(config, app.state.gateway, backend, drain_timeout=0.3)
    thread = threading.Thread(target=server.run, name="moa-drain-test", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.02)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        disconnects = upstream.disconnects
        body = {"model": "llama-8b", "messages": [{"role": "user", "content": "hang"}], "stream": True}
        events = []
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if '"content": "alpha"' in line:
                    assert backend.load() == (1, 0)
                    server.begin_drain()  # as SIGTERM does; on_tick aborts at the deadline
        error = json.loads(events[-2])["error"]
        assert events[-1] == "[DONE]" and set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "server_error" and error["code"] == "service_unavailable"
        assert "drain deadline" in error["message"]
        thread.join(30)
        assert not thread.is_alive(), "the gateway did not exit after the drain deadline"
        assert backend.load() == (0, 0) and not backend._open
        deadline = time.monotonic() + 10
        while upstream.disconnects == disconnects and time.monotonic() < deadline:
            time.sleep(0.05)
        assert upstream.disconnects == disconnects + 1  # the upstream saw its request closed
        requests = metrics.requests.labels(drafter="moa", backend="sglang", status="rejected")._value.get()
        assert requests == 1  # counted as the embedded backend's aborted-at-shutdown requests are
        assert not [s for f in metrics.request_faults.collect() for s in f.samples if s.value]  # not a fault
    finally:
        server.should_exit = True
        thread.join(30)


def test_the_same_fair_admission_guards_the_upstream(upstream, tmp_path):
    """The embedded engine's Must-show through --backend sglang: a plain keys file (two tenants of equal weight),
    at most 4 upstream requests and 4 waiting; A keeps 12 in flight, B sends one at a time. B gets no 429 and each
    of its requests goes upstream before every A request waiting when it arrived; A's excess gets 429 +
    Retry-After; answers are the upstream's. Order from the admission queue's log, not from timing: the upstream
    holds A's first requests until the test opens its gate."""
    keys = ("sk-upstream-a-7d1e", "sk-upstream-b-c40f")
    (tmp_path / "keys").write_text("\n".join(keys) + "\n")
    srv, telemetry = gateway(upstream.url, keys=APIKeys(file=tmp_path / "keys"), admission=Admission(4, 4))
    backend = srv.server.config.app.state.backend
    body_a = {"model": "llama-8b", "messages": [{"role": "user", "content": "gated"}], "max_tokens": 3}
    body_b = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    b_responses = []

    def post_b():
        r = httpx.post(srv.url + "/v1/chat/completions", json=body_b, headers={"Authorization": f"Bearer {keys[1]}"})
        b_responses.append(r)

    with srv, AdmissionLog() as log:
        upstream.gate.clear()
        fa = flood(srv.url, "/v1/chat/completions", body_a, keys[0], clients=12)
        try:
            wait_for("A's 4 upstream and 4 waiting", lambda: backend.load() == (4, 4))
            wait_for("A's excess refused", lambda: fa.statuses().count(429) >= 4)
            first_b = threading.Thread(target=post_b)
            first_b.start()
            wait_for(
                "B's request queued (or answered)",
                lambda: ("queued", "key2") in [e[:2] for e in log.events] or b_responses,
            )
            upstream.gate.set()
            first_b.join(60)
            for _ in range(2):
                wait_for("A's queue refilled", lambda: backend.load()[1] >= 3)
                post_b()
        finally:
            upstream.gate.set()
            fa.stop.set()
            for t in fa.threads:
                t.join(60)
        metrics = httpx.get(srv.url + "/metrics").text

    assert [r.status_code for r in b_responses] == [200] * 3, [r.text for r in b_responses]
    assert all(r.json()["choices"][0]["message"]["content"] == expected(2) for r in b_responses)
    assert {s for s, _, _ in fa.results} <= {200, 429}
    assert all(b["choices"][0]["message"]["content"] == expected(3) for s, _, b in fa.results if s == 200)
    refused = [(retry, b) for s, retry, b in fa.results if s == 429]
    assert len(refused) >= 4 and all(
        int(retry) >= 1 and b["error"]["code"] == "rate_limit_exceeded" for retry, b in refused
    )
    arrivals = log.queued_at_arrivals("key2")
    assert len(arrivals) == 3 and arrivals[0][1], "B's first request found A's queue full"
    for seq, a_waiting in arrivals:
        assert not a_waiting & set(log.admitted_before(seq)), f"an A request queued before B's #{seq} went first"
    assert 'moa_tenant_rejections_total{backend="sglang",drafter="moa",reason="queue",tenant="key1"}' in metrics
    assert 'moa_tenant_requests_total{backend="sglang",drafter="moa",status="ok",tenant="key2"} 3.0' in metrics
    for secret in keys:
        assert secret not in metrics and not [line for line in log.lines if secret in line]
    assert backend.load() == (0, 0)
