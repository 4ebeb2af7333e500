"""Gateway robustness on a real uvicorn server (127.0.0.1) with a tiny random Llama + the SmolLM2 tokenizer.

The model is irrelevant here (garbage text, milliseconds per step): error shapes, limits, auth,
queue overflow, drafter faults, engine failures.
"""

import concurrent.futures as cf
import itertools
import json
import logging
import os
import socket
import threading
import time

import httpx
import openai
import pytest
from helpers import compare_to_reference, slots_whole, tiny_config, tiny_state

from serving.backends.base import Admission
from serving.config import EngineConfig
from serving.engine import Engine
from serving.gateway.app import GatewayConfig, create_app
from serving.gateway.auth import APIKeys
from serving.gateway.schemas import Limits
from serving.gateway.server import ServerThread, embedded_backend
from sglang_ext.drafters import NgramDrafter
from sglang_ext.models import LlamaModel, Target
from sglang_ext.models.loader import load_tokenizer, resolve_target
from sglang_ext.sampling import SamplingParams
from sglang_ext.tree import TreeShape, chain_tree

MODEL = "tiny"
TREE = TreeShape(3, 2, 6)
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config(vocab=49152, hidden=32, layers=2)
    return Target(LlamaModel(cfg, tiny_state(cfg, seed=3)), load_tokenizer(resolve_target("smollm2")), None)


def serve(
    target,
    drafter=None,
    *,
    drafter_name="ngram",
    max_running=64,
    max_queue=256,
    limits=Limits(),
    keys=None,
    kv_slots=4096,
):
    """(ServerThread context, engine, telemetry) for an embedded backend on `target`."""
    engine = Engine(
        target, drafter if drafter is not None else NgramDrafter(), EngineConfig(tree=TREE, kv_slots=kv_slots)
    )
    backend, telemetry = embedded_backend(engine, MODEL, drafter_name, admission=Admission(max_running, max_queue))
    app = create_app(backend, telemetry, GatewayConfig(limits=limits, api_keys=keys))
    return ServerThread(app), engine, telemetry


@pytest.fixture(scope="module")
def server(tiny):
    srv, engine, telemetry = serve(tiny, limits=Limits(max_n=4, max_tokens=256, max_body_bytes=64 * 1024))
    with srv:
        srv.engine, srv.telemetry = engine, telemetry
        yield srv


def msg(content="hello", **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw}


def assert_error_shape(r: httpx.Response, status: int, param=None, code=None):
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


LONG = "word " * 3000  # > the tiny model's 512-token context
BAD_REQUESTS = [
    # (name, method, path, body (dict | str | bytes), status, param, code)
    ("invalid json", "POST", CHAT, "{not json", 400, None, "invalid_json"),
    ("empty body", "POST", CHAT, b"", 400, None, "invalid_json"),
    ("array body", "POST", CHAT, "[1, 2]", 400, None, "invalid_json"),
    ("missing messages", "POST", CHAT, {"model": MODEL}, 400, "messages", "missing_required_parameter"),
    ("empty messages", "POST", CHAT, {**msg(), "messages": []}, 400, "messages", None),
    ("cache_salt not a string", "POST", CHAT, msg(cache_salt=123), 400, "cache_salt", "invalid_value"),
    ("cache_salt too long", "POST", CHAT, msg(cache_salt="s" * 257), 400, "cache_salt", "invalid_value"),
    ("cache_salt empty", "POST", CHAT, msg(cache_salt=""), 400, "cache_salt", "invalid_value"),
    (
        "completions cache_salt a list",
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "cache_salt": ["a"]},
        400,
        "cache_salt",
        "invalid_value",
    ),
    (
        "bad role",
        "POST",
        CHAT,
        {**msg(), "messages": [{"role": "robot", "content": "x"}]},
        400,
        "messages[0].role",
        None,
    ),
    (
        "content not text",
        "POST",
        CHAT,
        {**msg(), "messages": [{"role": "user", "content": 42}]},
        400,
        "messages[0].content",
        None,
    ),
    (
        "image content",
        "POST",
        CHAT,
        {**msg(), "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
        400,
        "messages[0].content[0]",
        "unsupported_parameter",
    ),
    (
        "function role",
        "POST",
        CHAT,
        {**msg(), "messages": [{"role": "function", "content": "x"}]},
        400,
        "messages[0].role",
        "unsupported_parameter",
    ),
    (
        "tool message without content",
        "POST",
        CHAT,
        {**msg(), "messages": [{"role": "tool", "tool_call_id": "c"}]},
        400,
        "messages[0].content",
        None,
    ),
    (
        "tool call arguments not JSON",
        "POST",
        CHAT,
        {
            **msg(),
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}],
                }
            ],
        },
        400,
        "messages[0].tool_calls[0].function.arguments",
        None,
    ),
    (
        "tool calls on a user message",
        "POST",
        CHAT,
        {**msg(), "messages": [{"role": "user", "content": "x", "tool_calls": []}]},
        400,
        "messages[0].tool_calls",
        None,
    ),
    ("temperature too high", "POST", CHAT, msg(temperature=3), 400, "temperature", None),
    ("temperature string", "POST", CHAT, msg(temperature="hot"), 400, "temperature", None),
    ("top_p zero", "POST", CHAT, msg(top_p=0), 400, "top_p", None),
    ("top_p above 1", "POST", CHAT, msg(top_p=1.5), 400, "top_p", None),
    ("top_k negative", "POST", CHAT, msg(top_k=-5), 400, "top_k", None),
    ("max_tokens zero", "POST", CHAT, msg(max_tokens=0), 400, "max_tokens", None),
    (
        "completions max_tokens zero without echo",
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "max_tokens": 0},
        400,
        "max_tokens",
        None,
    ),
    ("max_tokens over limit", "POST", CHAT, msg(max_tokens=100000), 400, "max_tokens", None),
    ("max_completion_tokens negative", "POST", CHAT, msg(max_completion_tokens=-1), 400, "max_completion_tokens", None),
    ("max_tokens float", "POST", CHAT, msg(max_tokens=2.5), 400, "max_tokens", None),
    ("n zero", "POST", CHAT, msg(n=0), 400, "n", None),
    ("n over limit", "POST", CHAT, msg(n=50), 400, "n", None),
    ("too many stop strings", "POST", CHAT, msg(stop=[f"s{i}" for i in range(20)]), 400, "stop", None),
    ("empty stop string", "POST", CHAT, msg(stop=[""]), 400, "stop", None),
    ("stop not a string", "POST", CHAT, msg(stop=5), 400, "stop", None),
    ("seed negative", "POST", CHAT, msg(seed=-1), 400, "seed", None),
    ("seed float", "POST", CHAT, msg(seed=1.5), 400, "seed", None),
    ("stream not bool", "POST", CHAT, msg(stream="yes"), 400, "stream", None),
    (
        "stream_options without stream",
        "POST",
        CHAT,
        msg(stream_options={"include_usage": True}),
        400,
        "stream_options",
        None,
    ),
    (
        "functions (deprecated API)",
        "POST",
        CHAT,
        msg(functions=[{"name": "f"}]),
        400,
        "functions",
        "unsupported_parameter",
    ),
    (
        "tool not a function",
        "POST",
        CHAT,
        msg(tools=[{"type": "code_interpreter"}]),
        400,
        "tools[0]",
        "unsupported_parameter",
    ),
    (
        "tool name invalid",
        "POST",
        CHAT,
        msg(tools=[{"type": "function", "function": {"name": "get weather"}}]),
        400,
        "tools[0].function.name",
        None,
    ),
    (
        "tool names repeated",
        "POST",
        CHAT,
        msg(tools=[{"type": "function", "function": {"name": "f"}}] * 2),
        400,
        "tools",
        None,
    ),
    (
        "tool parameters not a schema",
        "POST",
        CHAT,
        msg(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]),
        400,
        "tools[0].function.parameters",
        None,
    ),
    ("tool_choice without tools", "POST", CHAT, msg(tool_choice="required"), 400, "tool_choice", None),
    (
        "tool_choice names an unknown function",
        "POST",
        CHAT,
        msg(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        400,
        "tool_choice",
        None,
    ),
    (
        "tool_choice invalid",
        "POST",
        CHAT,
        msg(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="always"),
        400,
        "tool_choice",
        None,
    ),
    (
        "required tool call with response_format",
        "POST",
        CHAT,
        msg(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice="required",
            response_format={"type": "json_object"},
        ),
        400,
        "tool_choice",
        None,
    ),
    ("top_logprobs without logprobs", "POST", CHAT, msg(top_logprobs=2), 400, "top_logprobs", None),
    ("top_logprobs over 20", "POST", CHAT, msg(logprobs=True, top_logprobs=21), 400, "top_logprobs", None),
    ("logprobs not a bool", "POST", CHAT, msg(logprobs="yes"), 400, "logprobs", None),
    ("presence_penalty over 2", "POST", CHAT, msg(presence_penalty=2.5), 400, "presence_penalty", None),
    ("frequency_penalty a string", "POST", CHAT, msg(frequency_penalty="high"), 400, "frequency_penalty", None),
    ("repetition_penalty zero", "POST", CHAT, msg(repetition_penalty=0), 400, "repetition_penalty", None),
    ("logit_bias key not a token id", "POST", CHAT, msg(logit_bias={"hello": 10}), 400, "logit_bias", None),
    ("logit_bias value over 100", "POST", CHAT, msg(logit_bias={"50": 101}), 400, "logit_bias", None),
    ("logit_bias value a string", "POST", CHAT, msg(logit_bias={"50": "up"}), 400, "logit_bias", None),
    (
        "logit_bias token out of vocab",
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "logit_bias": {"49152": 5}},
        400,
        "logit_bias",
        None,
    ),
    (
        "logit_bias too many tokens",
        "POST",
        CHAT,
        msg(logit_bias={str(i): 1 for i in range(301)}),
        400,
        "logit_bias",
        None,
    ),
    (
        "response_format xml",
        "POST",
        CHAT,
        msg(response_format={"type": "xml"}),
        400,
        "response_format",
        "unsupported_parameter",
    ),
    (
        "json_schema without a schema",
        "POST",
        CHAT,
        msg(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        400,
        "response_format",
        None,
    ),
    (
        "json_schema invalid",
        "POST",
        CHAT,
        msg(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}),
        400,
        "response_format",
        None,
    ),
    ("regex invalid", "POST", "/v1/completions", {"model": MODEL, "prompt": "a", "regex": "([a"}, 400, "regex", None),
    (
        "regex with response_format",
        "POST",
        CHAT,
        msg(regex="a+", response_format={"type": "json_object"}),
        400,
        "regex",
        None,
    ),
    ("min_tokens over max_tokens", "POST", CHAT, msg(min_tokens=5, max_tokens=4), 400, "min_tokens", None),
    ("min_tokens negative", "POST", CHAT, msg(min_tokens=-1), 400, "min_tokens", None),
    (
        "min_tokens with a grammar",
        "POST",
        CHAT,
        msg(min_tokens=2, response_format={"type": "json_object"}),
        400,
        "min_tokens",
        None,
    ),
    (
        "prediction of an unknown type",
        "POST",
        CHAT,
        msg(prediction={"type": "diff", "content": "x"}),
        400,
        "prediction",
        None,
    ),
    (
        "prediction content not text",
        "POST",
        CHAT,
        msg(prediction={"type": "content", "content": [{"type": "image_url"}]}),
        400,
        "prediction",
        None,
    ),
    (
        "ignore_eos with a grammar",
        "POST",
        CHAT,
        msg(ignore_eos=True, response_format={"type": "json_object"}),
        400,
        "ignore_eos",
        None,
    ),
    ("unknown model", "POST", CHAT, {**msg(), "model": "gpt-9"}, 404, "model", "model_not_found"),
    ("prompt too long", "POST", CHAT, msg(LONG[:20000]), 400, "messages", "context_length_exceeded"),
    (
        "prompt + max_tokens over context",
        "POST",
        CHAT,
        msg(max_tokens=250, content="x " * 300),
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    ("body too large", "POST", CHAT, msg(LONG * 5), 413, None, "request_too_large"),
    (
        "completions missing prompt",
        "POST",
        "/v1/completions",
        {"model": MODEL},
        400,
        "prompt",
        "missing_required_parameter",
    ),
    ("completions empty prompt", "POST", "/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt", None),
    (
        "completions token out of vocab",
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": [1, 2, 10**9]},
        400,
        "prompt",
        None,
    ),
    (
        "completions logprobs negative",
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "logprobs": -1},
        400,
        "logprobs",
        None,
    ),
    (
        "completions best_of",
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "best_of": 3},
        400,
        "best_of",
        "unsupported_parameter",
    ),
    (
        "tokenize with prompt and messages",
        "POST",
        "/tokenize",
        {"prompt": "a", "messages": [{"role": "user", "content": "a"}]},
        400,
        "prompt",
        None,
    ),
    ("tokenize with neither", "POST", "/tokenize", {"model": MODEL}, 400, "prompt", None),
    ("tokenize unknown model", "POST", "/tokenize", {"model": "gpt-9", "prompt": "a"}, 404, "model", "model_not_found"),
    ("detokenize token out of vocab", "POST", "/detokenize", {"tokens": [1, 49152]}, 400, "tokens", None),
    ("detokenize tokens not ints", "POST", "/detokenize", {"tokens": ["a"]}, 400, None, None),
    ("unknown route", "POST", "/v1/nothing", msg(), 404, None, "not_found"),
    ("wrong method", "GET", CHAT, None, 405, None, "method_not_allowed"),
    ("unknown model card", "GET", "/v1/models/nope", None, 404, "model", "model_not_found"),
]


def test_bad_requests_get_openai_errors_and_server_keeps_answering(server):
    assert len(BAD_REQUESTS) >= 20
    assert slots_whole(server.engine)
    invalid0 = server.telemetry._requests["invalid"]._value.get()
    posted = 0
    with httpx.Client(base_url=server.url, timeout=30) as c:
        for name, method, path, body, status, param, code in BAD_REQUESTS:
            content = body if isinstance(body, (str, bytes)) else None if body is None else json.dumps(body)
            r = c.request(method, path, content=content, headers={"content-type": "application/json"})
            try:
                assert_error_shape(r, status, param, code)
            except AssertionError as e:
                raise AssertionError(f"{name}: {e}") from None
            posted += path in (CHAT, "/v1/completions") and method == "POST"
        ok = c.post(CHAT, json=msg())
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None
        assert c.get("/health").json() == {"status": "ok"}
    assert slots_whole(server.engine)  # (the good request's tokens may stay in the prefix cache)
    assert server.telemetry._requests["invalid"]._value.get() - invalid0 == posted


def test_openai_client_raises_typed_errors(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=5)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])


def test_draining_server_rejects_new_requests_with_503(server):
    state = server.server.config.app.state.gateway
    state.draining = True
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            r = c.post(CHAT, json=msg())
            assert_error_shape(r, 503, code="service_unavailable")
            assert r.headers["retry-after"]
            assert_error_shape(c.get("/ready"), 503)
            assert c.get("/health").status_code == 200
    finally:
        state.draining = False
    assert httpx.get(server.url + "/ready").json()["status"] == "ready"


def test_api_keys(tiny, tmp_path):
    f = tmp_path / "keys"
    f.write_text("file-key\n")
    srv, _, _ = serve(tiny, keys=APIKeys(["env-key"], f))
    with srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        for headers in (
            {},
            {"authorization": "Bearer wrong"},
            {"authorization": "Basic file-key"},
            {"authorization": "Bearer"},
        ):
            r = c.post(CHAT, json=msg(), headers=headers)
            assert_error_shape(r, 401, code="invalid_api_key")
            assert r.headers["www-authenticate"] == "Bearer"
        assert_error_shape(c.get("/v1/models"), 401)
        assert_error_shape(c.get("/v1/nothing"), 401)  # no route probing without a key
        for key in ("env-key", "file-key"):
            assert c.post(CHAT, json=msg(), headers={"authorization": f"Bearer {key}"}).status_code == 200
        for path in ("/health", "/ready", "/metrics"):
            assert c.get(path).status_code == 200, path
        ok = openai.OpenAI(base_url=srv.url + "/v1", api_key="file-key", max_retries=0)
        assert ok.models.list().data[0].id == MODEL
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_a_keys_tenant_limits_tokens_per_minute(tiny, tmp_path):
    """A key's tokens_per_minute counts prompt + max_tokens of its requests in the last minute (settled to what
    they used): over it a 429 with Retry-After; one request over it alone a 400 naming max_tokens; another key's
    requests are not refused because of it."""
    f = tmp_path / "keys"
    f.write_text("sk-metered tenant=metered tokens_per_minute=300\nsk-free\n")
    srv, _, telemetry = serve(tiny, keys=APIKeys(file=f))
    body = msg(max_tokens=100, ignore_eos=True)  # ~110 tokens with the prompt
    with srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        metered, free = ({"authorization": f"Bearer {k}"} for k in ("sk-metered", "sk-free"))
        assert [c.post(CHAT, json=body, headers=metered).status_code for _ in range(2)] == [200, 200]
        r = c.post(CHAT, json=body, headers=metered)
        err = assert_error_shape(r, 429, code="rate_limit_exceeded")
        assert 1 <= int(r.headers["retry-after"]) <= 60 and "tokens per minute" in err["message"]
        err = assert_error_shape(c.post(CHAT, json=msg(max_tokens=400), headers=metered), 400, param="max_tokens")
        assert "300 tokens per minute" in err["message"]
        assert [c.post(CHAT, json=body, headers=free).status_code for _ in range(3)] == [200] * 3
        metrics = c.get("/metrics").text
    assert 'reason="tokens_per_minute",tenant="metered"} 1.0' in metrics
    assert 'reason="too_large",tenant="metered"} 1.0' in metrics
    assert 'status="ok",tenant="key2"} 3.0' in metrics  # sk-free: the second key, unnamed
    assert "sk-metered" not in metrics and "sk-free" not in metrics


def test_a_bad_keys_file_is_a_one_line_error_and_a_bad_reload_keeps_the_keys(tmp_path, capsys, caplog, monkeypatch):
    from moa_serve.entrypoints.cli import main

    f = tmp_path / "keys"
    f.write_text("sk-good-1\nsk-good-2 tenant=team weight=two\n")
    assert main(["serve", "--api-keys-file", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"API keys file {f} line 2: weight must be a number > 0, got 'two'" in err
    assert "sk-good" not in err
    f.write_text("sk-good-1\n")
    keys = APIKeys(file=f)
    assert keys.tenant_of("Bearer sk-good-1").name == "key1"
    f.write_text("sk-good-1\nsk-good-1 tenant=again\n")  # a rotation gone wrong: the last good keys stay
    os.utime(f, (time.time() + 5, time.time() + 5))
    monkeypatch.setattr("serving.gateway.auth.RELOAD_CHECK_S", 0.0)
    with caplog.at_level(logging.ERROR, logger="serving.gateway.auth"):
        assert keys.check("Bearer sk-good-1")
    assert "line 2: the same key as line 1; keeping the keys read before" in caplog.text
    assert "sk-good" not in caplog.text


class SlowDrafter(NgramDrafter):
    """n-gram drafter that sleeps in propose: a request stays in flight for a while (a client that gives up,
    a step that fails mid-stream, a drain), whatever it is checked against."""

    def propose(self, batch, shape):
        time.sleep(0.05)
        return super().propose(batch, shape)


class GatedDrafter(NgramDrafter):
    """n-gram drafter whose propose waits for the test to open a gate: the requests it drafts for stay in
    flight (none can finish) until then, however fast or slow the machine."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()

    def propose(self, batch, shape):
        assert self.gate.wait(timeout=120), "the test never opened the gate"
        return super().propose(batch, shape)


def test_queue_overflow_gets_429_with_retry_after(tiny):
    drafter = GatedDrafter()
    srv, engine, telemetry = serve(tiny, drafter, max_running=2, max_queue=2)
    body = msg(max_tokens=24, ignore_eos=True)
    with srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        with cf.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(c.post, CHAT, json=body) for _ in range(8)]
            # 2 running + 2 queued are held at the gate; the other 4 are answered while it is shut
            early = [f.result() for f in itertools.islice(cf.as_completed(futures, timeout=60), 4)]
            assert [r.status_code for r in early] == [429] * 4
            drafter.gate.set()
            responses = [f.result() for f in futures]
        codes = sorted(r.status_code for r in responses)
        assert codes == [200] * 4 + [429] * 4, codes
        for r in responses:
            if r.status_code == 429:
                assert_error_shape(r, 429, code="rate_limit_exceeded")
                assert int(r.headers["retry-after"]) >= 1
            else:
                assert r.json()["usage"]["completion_tokens"] == 24
        assert c.post(CHAT, json=msg()).status_code == 200  # capacity is back
    assert telemetry._requests["rejected"]._value.get() == 4
    assert slots_whole(engine)


class FaultyDrafter(NgramDrafter):
    """Fails from the `after`-th propose on: raises, or proposes an out-of-vocabulary token."""

    def __init__(self, after: int, mode: str):
        super().__init__()
        self.after, self.mode, self.calls = after, mode, 0

    def propose(self, batch, shape):
        self.calls += 1
        trees = super().propose(batch, shape)
        if self.calls >= self.after:
            if self.mode == "raise":
                raise RuntimeError("injected drafter fault")
            trees = [chain_tree(d.token_ids[-1], [10**9], d.seq_len) for d in batch]
        return trees


@pytest.mark.parametrize("mode,reason", [("raise", "RuntimeError"), ("invalid", "invalid_draft")])
def test_drafter_fault_falls_back_with_correct_output(tiny, mode, reason):
    prompts = ["Tell me a story about a cat.", "List some colors.", "Why is the sky blue?"]
    ids = [tiny.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    ref = [r.output_ids for r in Engine(tiny, None).generate(ids, SamplingParams(max_new_tokens=20, ignore_eos=True))]
    srv, engine, telemetry = serve(tiny, FaultyDrafter(after=3, mode=mode), drafter_name="faulty")
    fallbacks = telemetry.metrics.drafter_fallbacks.labels(drafter="faulty", backend="embedded", reason=reason)
    with srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        with cf.ThreadPoolExecutor(3) as pool:
            outs = list(
                pool.map(
                    lambda p: c.post(
                        CHAT, json=msg(p, max_tokens=20, temperature=0, ignore_eos=True, return_token_ids=True)
                    ).json(),
                    prompts,
                )
            )
        metrics_text = c.get("/metrics").text
    for p, r, o in zip(ids, ref, outs):
        got = o["choices"][0]["token_ids"]
        assert compare_to_reference(tiny.model, p, r, got) != "bug"
        assert o["choices"][0]["message"]["content"] == tiny.decode(got)
    assert fallbacks._value.get() == 3
    assert f'moa_drafter_fallbacks_total{{backend="embedded",drafter="faulty",reason="{reason}"}} 3.0' in metrics_text
    assert slots_whole(engine)


def test_engine_step_failure_is_a_500_and_the_server_recovers(tiny):
    srv, engine, telemetry = serve(tiny)
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected engine fault")
        return real_step()

    engine.step = flaky_step
    with srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        assert_error_shape(c.post(CHAT, json=msg(max_tokens=8)), 500, code="internal_error")
        assert c.post(CHAT, json=msg(max_tokens=8)).status_code == 200
    assert telemetry._requests["error"]._value.get() == 1
    assert slots_whole(engine)


def test_unexpected_exception_is_an_openai_500(tiny, monkeypatch):
    srv, _, _ = serve(tiny)
    backend = srv.server.config.app.state.backend

    def broken(job):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(backend, "generate", broken)
    with srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        err = assert_error_shape(c.post(CHAT, json=msg()), 500, code="internal_error")
        assert "boom" not in err["message"]  # no internals leak to clients
        assert c.get("/health").status_code == 200


def test_non_streaming_client_timeout_aborts_the_request(tiny):
    srv, engine, telemetry = serve(tiny, SlowDrafter())
    engine_loop = srv.server.config.app.state.backend.engine_loop
    with srv:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + CHAT, json=msg(max_tokens=200, ignore_eos=True), timeout=0.5)
        deadline = time.monotonic() + 10
        while engine_loop.load() != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine_loop.load() == (0, 0) and slots_whole(engine)
    assert telemetry._requests["aborted"]._value.get() == 1


def test_engine_failure_mid_stream_is_an_error_event(tiny):
    srv, engine, telemetry = serve(tiny, SlowDrafter())
    real_step, calls = engine.step, {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected engine fault")
        return real_step()

    engine.step = flaky_step
    with srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        got = []
        with pytest.raises(openai.APIError, match="internal error"):
            stream = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=50,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for ch in stream:
                got.append(ch)
        assert got, "the stream had started before the fault"
        assert client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        ).choices
    assert telemetry._requests["error"]._value.get() == 1
    assert slots_whole(engine)


def test_drain_deadline_aborts_what_is_left_and_exits(tiny):
    import threading

    import uvicorn

    from serving.gateway.server import DrainingServer

    engine = Engine(tiny, SlowDrafter(), EngineConfig(tree=TREE, kv_slots=4096))
    backend, telemetry = embedded_backend(engine, MODEL, "ngram")
    app = create_app(backend, telemetry)
    server = DrainingServer(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=5),
        app.state.gateway,
        backend,
        drain_timeout=1.0,
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(httpx.post, url + CHAT, json=msg(max_tokens=300, ignore_eos=True), timeout=60)
        while backend.load()[0] < 1:
            time.sleep(0.02)
        t0 = time.monotonic()
        server.begin_drain()  # what SIGTERM does (signals reach only the main thread)
        r = fut.result()
    assert_error_shape(r, 503, code="service_unavailable")
    thread.join(20)
    assert not thread.is_alive() and time.monotonic() - t0 < 10
    assert slots_whole(engine)


def _partial_upload(port: int, sent: bytes = b'{"model": "tiny", ') -> socket.socket:
    """A connection that sends a chat request's headers and the start of a 1000-byte body, then stalls."""
    s = socket.create_connection(("127.0.0.1", port))
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
        b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    )
    s.sendall(head + sent)
    return s


def test_disconnect_during_upload_is_an_abort_not_an_error(server, caplog):
    requests = server.telemetry._requests
    aborted0, error0 = requests["aborted"]._value.get(), requests["error"]._value.get()
    with caplog.at_level(logging.INFO):
        for _ in range(5):
            _partial_upload(server.port).close()
        deadline = time.monotonic() + 60
        while requests["aborted"]._value.get() - aborted0 < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert requests["aborted"]._value.get() - aborted0 == 5 and requests["error"]._value.get() == error0
    noisy = [r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]
    assert not noisy, noisy
    assert httpx.post(server.url + CHAT, json=msg(), timeout=30).status_code == 200


def test_a_stalled_upload_does_not_hold_the_drain_and_gets_an_openai_503(tiny):
    import threading

    import uvicorn

    from serving.gateway.server import DrainingServer

    engine = Engine(tiny, NgramDrafter(), EngineConfig(tree=TREE, kv_slots=4096))
    backend, telemetry = embedded_backend(engine, MODEL, "ngram")
    app = create_app(backend, telemetry)
    # NOTE: a drain timeout no test waits for: the server exits before it only if the upload does not count
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=5)
    server = DrainingServer(config, app.state.gateway, backend, drain_timeout=3600)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    stalled = _partial_upload(server.servers[0].sockets[0].getsockname()[1])
    while not server.server_state.tasks:  # the request reached the app (which now reads its body)
        time.sleep(0.02)
    assert app.state.gateway.in_flight == 0  # an upload is not in flight
    server.begin_drain()
    thread.join(120)
    assert not thread.is_alive(), "the stalled upload held the drain"
    stalled.settimeout(30)
    reply = b""
    while chunk := stalled.recv(65536):
        reply += chunk
    stalled.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), reply[:300]
    err = json.loads(body)["error"]
    assert err["code"] == "service_unavailable" and err["type"] and err["message"], err
    assert telemetry._requests["rejected"]._value.get() == 1 and telemetry._requests["error"]._value.get() == 0
