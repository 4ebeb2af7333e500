"""The gateway on a real uvicorn server (127.0.0.1) with the real SmolLM2 (fp32) + n-gram drafter,
via the real openai client.

Covers: response shapes (ChatCompletion / ChatCompletionChunk / Completion), include_usage, n, stop
strings, seeds, API == `moa-serve generate`, 32 concurrent streams == each alone, 50 dropped
streams free their KV, and /metrics (promtool + counters moving).
"""

import asyncio
import concurrent.futures as cf
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from helpers import compare_to_reference, reference_greedy, reference_logprobs, slots_whole
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from prometheus_client.parser import text_string_to_metric_families

from serving.config import EngineConfig
from serving.engine import Engine
from serving.gateway.app import create_app
from serving.gateway.server import ServerThread, embedded_backend
from sglang_ext.drafters import default_tree, make_drafter
from sglang_ext.grammar import GrammarSpec
from sglang_ext.sampling import SamplingParams

MODEL = "smollm2"
DRAFTER = "ngram"
CHAT = "/v1/chat/completions"
SPEC_KEYS = {"spec_accept_length", "spec_verify_ct", "spec_draft_tokens", "spec_accepted_tokens"}


@pytest.fixture(scope="module")
def server(smollm2_fp32):
    engine = Engine(
        smollm2_fp32, make_drafter(DRAFTER, smollm2_fp32), EngineConfig(tree=default_tree(DRAFTER), kv_slots=8192)
    )
    backend, telemetry = embedded_backend(engine, MODEL, DRAFTER)
    with ServerThread(create_app(backend, telemetry)) as srv:
        srv.engine, srv.telemetry, srv.backend = engine, telemetry, backend
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def user(text, system="Be brief."):
    return [{"role": "system", "content": system}, {"role": "user", "content": text}]


def sse_objects(resp: httpx.Response) -> list:
    """The JSON objects of an SSE response, checking it ends with [DONE]."""
    lines = [ln[len("data: ") :] for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_chat_shapes_usage_and_spec_stats(server, client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=user("Name three colors."), max_tokens=12, temperature=0
    )
    body = raw.http_response.json()
    full = ChatCompletion.model_validate(body)
    assert full.choices[0].finish_reason in ("stop", "length") and full.choices[0].message.role == "assistant"
    assert (
        full.usage.completion_tokens <= 12
        and full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    )
    assert SPEC_KEYS <= set(body["meta_info"]) and SPEC_KEYS <= set(body["choices"][0]["meta_info"])
    assert body["meta_info"]["spec_verify_ct"] >= 1

    with httpx.Client(base_url=server.url, timeout=300) as c:
        req = {
            "model": MODEL,
            "messages": user("Name three colors."),
            "max_tokens": 12,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with c.stream("POST", CHAT, json=req) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            objs = sse_objects(r)
    chunks = [ChatCompletionChunk.model_validate(o) for o in objs]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({ch.id for ch in chunks}) == 1
    *content, usage = chunks
    streamed, whole = usage.usage.model_dump(), full.usage.model_dump()
    # the same prompt again: all but its last token came from the prefix cache
    assert streamed.pop("prompt_tokens_details")["cached_tokens"] == full.usage.prompt_tokens - 1
    whole.pop("prompt_tokens_details")
    assert usage.choices == [] and streamed == whole
    assert SPEC_KEYS <= set(objs[-1]["meta_info"])
    assert "".join(ch.choices[0].delta.content or "" for ch in content) == full.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in content if ch.choices[0].finish_reason] == [
        full.choices[0].finish_reason
    ]

    # the openai client's own streaming path; without include_usage there is no usage chunk
    stream = client.chat.completions.create(
        model=MODEL, messages=user("Name three colors."), max_tokens=12, temperature=0, stream=True
    )
    parts = list(stream)
    assert all(p.usage is None for p in parts) and all(p.choices for p in parts)
    assert "".join(p.choices[0].delta.content or "" for p in parts) == full.choices[0].message.content


def test_completions_endpoint_shapes(server, client):
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    full = Completion.model_validate(raw.http_response.json())
    assert full.object == "text_completion" and full.choices[0].text
    with httpx.Client(base_url=server.url, timeout=300) as c:
        req = {
            "model": MODEL,
            "prompt": "The capital of France is",
            "max_tokens": 8,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with c.stream("POST", "/v1/completions", json=req) as r:
            objs = sse_objects(r)
    # openai's Completion types finish_reason as non-null, so mid-stream chunks (finish_reason: null, as
    # OpenAI sends them) validate once it is filled in; the finish and usage chunks validate as they are
    chunks = [
        Completion.model_validate(
            o
            if not o["choices"] or o["choices"][0]["finish_reason"]
            else {**o, "choices": [{**o["choices"][0], "finish_reason": "length"}]}
        )
        for o in objs
    ]
    assert all(set(o["choices"][0]) >= {"index", "text", "finish_reason", "logprobs"} for o in objs if o["choices"])
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert client.models.list().data[0].id == MODEL


def test_n_and_seeds(server, client):
    kw = dict(
        model=MODEL, messages=user("Write a short sentence about the sea."), max_tokens=10, temperature=1.0, top_p=0.95
    )
    both = client.chat.completions.create(n=2, seed=11, **kw)
    assert sorted(c.index for c in both.choices) == [0, 1]
    alone = [client.chat.completions.create(seed=11 + i, **kw).choices[0].message.content for i in range(2)]
    again = client.chat.completions.create(seed=11, **kw).choices[0].message.content
    assert again == alone[0], "same seed must give the same text"
    assert [c.message.content for c in sorted(both.choices, key=lambda c: c.index)] == alone, (
        "choice i of n uses seed + i"
    )
    assert 2 <= both.usage.completion_tokens <= 20

    stream = client.chat.completions.create(n=2, seed=11, stream=True, stream_options={"include_usage": True}, **kw)
    texts, finishes = {0: "", 1: ""}, {}
    for ch in stream:
        ChatCompletionChunk.model_validate(ch.model_dump())
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert [texts[0], texts[1]] == alone and set(finishes) == {0, 1}
    assert ch.usage.completion_tokens == both.usage.completion_tokens


def test_stop_strings(server, client):
    kw = dict(
        model=MODEL,
        messages=user("Explain what a tree is in two sentences.", system="You are a teacher."),
        max_tokens=24,
        temperature=0,
    )
    ref = client.chat.completions.create(**kw).choices[0].message.content
    k = len(ref) // 2
    stop = ref[k : k + 3]
    expected = ref[: ref.index(stop)]
    out = client.chat.completions.create(stop=[stop, "never-appears-xyz"], **kw).choices[0]
    assert (out.message.content, out.finish_reason) == (expected, "stop")
    assert client.chat.completions.create(stop=stop, **kw).choices[0].message.content == expected

    pieces, finish = [], None
    for ch in client.chat.completions.create(stop=stop, stream=True, **kw):
        for c in ch.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(pieces) == expected and finish == "stop"
    assert not any(stop in p for p in pieces)


def test_greedy_text_equals_cli_generate(server, client):
    prompt = "Give two tips for sleeping well."
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = Path(sys.executable).parent / "moa-serve"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "moa_serve.entrypoints.cli"]
    cli = subprocess.run(
        [
            *cmd,
            "generate",
            "--chat",
            "--prompt",
            prompt,
            "--dtype",
            "float32",
            "--drafter",
            DRAFTER,
            "--max-new-tokens",
            "24",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert cli.returncode == 0, cli.stderr
    ref = json.loads(cli.stdout.strip().splitlines()[-1])
    api = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=24,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert api.choices[0].message.content == ref["text"]
    assert api.choices[0].token_ids == ref["token_ids"]


def test_logprobs_chat_stream_completions_and_stop(server, client, smollm2_fp32):
    """logprobs / top_logprobs are the target's (a plain forward over the output agrees), the same
    streamed and not, in the legacy completions shape too, and cut with the text at a stop string."""
    kw = dict(
        model=MODEL, messages=user("List three fruits."), max_tokens=14, temperature=0, logprobs=True, top_logprobs=2
    )
    full = client.chat.completions.create(extra_body={"return_token_ids": True}, **kw)
    ChatCompletion.model_validate(full.model_dump())
    choice = full.choices[0]
    entries = choice.logprobs.content
    ids = choice.token_ids
    assert len(entries) == len(ids) == full.usage.completion_tokens
    prompt = smollm2_fp32.encode_chat(user("List three fruits."))
    ref = reference_logprobs(smollm2_fp32.model, prompt, ids)
    for i, (e, t) in enumerate(zip(entries, ids)):
        assert abs(e.logprob - float(ref[i, t])) < 1e-4
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-4)  # greedy: the likeliest token
    text = b"".join(bytes(e.bytes) for e in entries).decode()
    assert text.startswith(choice.message.content) and text[len(choice.message.content) :] in ("", "<|im_end|>")

    streamed = []
    for ch in client.chat.completions.create(stream=True, **kw):
        ChatCompletionChunk.model_validate(ch.model_dump())
        for c in ch.choices:
            streamed += c.logprobs.content if c.logprobs and c.logprobs.content else []
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    plain = client.chat.completions.create(
        model=MODEL, messages=user("List three fruits."), max_tokens=14, temperature=0
    )
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == choice.message.content

    comp = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=3
    )
    lp = comp.choices[0].logprobs
    assert (
        len(lp.tokens)
        == len(lp.token_logprobs)
        == len(lp.top_logprobs)
        == len(lp.text_offset)
        == comp.usage.completion_tokens
    )
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(
        len(t) == 3 and max(t.values()) == pytest.approx(v, abs=1e-4)
        for t, v in zip(lp.top_logprobs, lp.token_logprobs)
    )

    stop = choice.message.content[6:9]
    cut = client.chat.completions.create(stop=stop, **kw).choices[0]
    assert (
        cut.finish_reason == "stop"
        and cut.message.content == choice.message.content[: choice.message.content.index(stop)]
    )
    kept = "".join(e.token for e in cut.logprobs.content)
    assert (
        stop in kept and stop not in kept[: -len(cut.logprobs.content[-1].token)]
    )  # through the token that completed the stop string


def test_completions_echo_with_prompt_logprobs(server, client, smollm2_fp32):
    """echo + logprobs (what lm-eval-harness's loglikelihood requests send): the prompt comes back
    first, its tokens scored by the target given their prefix (the first one: null), then the output."""
    prompt = "The capital of France is Paris. The capital of Italy is"
    ids = smollm2_fp32.encode(prompt)
    out = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=2,
        temperature=0,
        logprobs=1,
        echo=True,
        extra_body={"return_token_ids": True},
    )
    c = out.choices[0]
    lp = c.logprobs
    assert (
        c.text.startswith(prompt)
        and c.text[len(prompt) :]
        == client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0).choices[0].text
    )
    assert len(lp.tokens) == len(ids) + 2 and out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and "".join(lp.tokens[: len(ids)]) == prompt
    ref = reference_logprobs(smollm2_fp32.model, ids[:1], ids[1:] + c.token_ids)
    for i, (tok_id, got) in enumerate(zip(ids[1:] + c.token_ids, lp.token_logprobs[1:])):
        assert abs(got - float(ref[i, tok_id])) < 1e-4
    assert lp.text_offset[len(ids)] == len(prompt)
    streamed = "".join(
        ch.choices[0].text
        for ch in client.completions.create(
            model=MODEL, prompt=ids, max_tokens=2, temperature=0, echo=True, stream=True
        )
        if ch.choices
    )
    assert streamed == smollm2_fp32.tokenizer.decode(ids) + c.text[len(prompt) :]
    # max_tokens 0: the prompt scored, nothing generated
    only = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, logprobs=0, echo=True)
    assert (
        only.choices[0].text == prompt
        and only.usage.completion_tokens == 0
        and only.choices[0].finish_reason == "length"
    )
    assert (
        only.choices[0].logprobs.token_logprobs == lp.token_logprobs[: len(ids)]
        and only.choices[0].logprobs.tokens == lp.tokens[: len(ids)]
    )
    deadline = time.monotonic() + 60  # a condition, not a speed: the abort is applied on the engine thread
    while not slots_whole(server.engine) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert slots_whole(server.engine)  # the dropped token's request freed its KV (or left it to the prefix cache)


def test_penalties_and_logit_bias(server, client, smollm2_fp32):
    """presence / frequency / repetition penalties through the API give plain penalised greedy
    decoding's tokens (the drafter's accepted tokens included), streamed and not; a -100 bias bans a
    token, +100 forces one."""
    messages = user("Write a short poem about the sea and the sky.")
    kw = dict(model=MODEL, messages=messages, max_tokens=24, temperature=0, presence_penalty=0.8, frequency_penalty=0.6)
    api = client.chat.completions.create(**kw, extra_body={"repetition_penalty": 1.2, "return_token_ids": True})
    got = api.choices[0].token_ids
    sp = SamplingParams(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.2)
    ref, gaps = reference_greedy(smollm2_fp32.model, smollm2_fp32.encode_chat(messages), sp, len(got))
    n = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
    assert n is None or gaps[n] < 1e-3, f"differs from plain penalised decoding at token {n}"
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, extra_body={"return_token_ids": True}
    )
    assert plain.choices[0].token_ids != got  # the penalties did something
    stream = client.chat.completions.create(**kw, stream=True, extra_body={"repetition_penalty": 1.2})
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == api.choices[0].message.content
    first = plain.choices[0].token_ids[0]
    banned = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=3,
        temperature=0,
        logit_bias={str(first): -100},
        extra_body={"return_token_ids": True},
    )
    assert first not in banned.choices[0].token_ids
    (sea,) = smollm2_fp32.encode(" sea")
    forced = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=3, temperature=0, logit_bias={str(sea): 100}
    )
    assert forced.choices[0].text == " sea" * 3


def test_structured_output(server, client, smollm2_fp32):
    """response_format json_schema / json_object and the regex extension: the output matches, and is
    plain constrained greedy decoding's (the drafter's accepted tokens included), streamed and not."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"],
    }
    messages = user("Tell me about Paris as JSON.")
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
    out = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=60,
        temperature=0,
        response_format=fmt,
        extra_body={"return_token_ids": True},
    )
    c = out.choices[0]
    data = json.loads(c.message.content)
    assert c.finish_reason == "stop" and set(data) == {"city", "population"} and isinstance(data["population"], int)
    sp = SamplingParams(grammar=GrammarSpec("json_schema", json.dumps(schema)))
    ref, gaps = reference_greedy(
        smollm2_fp32.model, smollm2_fp32.encode_chat(messages), sp, 60, server.engine.grammars, server.engine.eos_ids
    )
    n = next((i for i, (a, b) in enumerate(zip(ref, c.token_ids)) if a != b), None)
    assert n is None or gaps[n] < 1e-3, f"differs from plain constrained decoding at token {n}"
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=60, temperature=0, response_format=fmt, stream=True
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == c.message.content
    obj = client.chat.completions.create(
        model=MODEL,
        messages=user("Describe a dog."),
        max_tokens=80,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)  # an object, as in OpenAI's JSON mode
    else:
        assert obj.choices[0].message.content.lstrip().startswith("{")
    date = client.completions.create(
        model=MODEL,
        prompt="The date today is",
        max_tokens=20,
        temperature=0,
        extra_body={"regex": r" [0-9]{4}-[0-9]{2}-[0-9]{2}"},
    )
    assert (
        re.fullmatch(r" [0-9]{4}-[0-9]{2}-[0-9]{2}", date.choices[0].text) and date.choices[0].finish_reason == "stop"
    )
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
        )
    assert e.value.body["param"] == "response_format" and "nope" in e.value.body["message"]


def test_min_tokens(client, server, smollm2_fp32):
    """The min_tokens extension: no end of text before that many tokens (the short answer goes on), as in
    plain decoding with EOS banned that long; streamed the same."""
    messages = user("Name one colour.", system="Answer with one word.")
    short = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert short.usage.completion_tokens < 14 and short.choices[0].finish_reason == "stop"
    kw = dict(
        model=MODEL,
        messages=messages,
        max_tokens=24,
        temperature=0,
        extra_body={"min_tokens": 14, "return_token_ids": True},
    )
    long = client.chat.completions.create(**kw)
    assert long.usage.completion_tokens >= 14
    ref, gaps = reference_greedy(
        smollm2_fp32.model,
        smollm2_fp32.encode_chat(messages),
        SamplingParams(max_new_tokens=24, min_tokens=14),
        24,
        stop_ids=server.engine.eos_ids,
    )
    n = next((i for i, (a, b) in enumerate(zip(ref, long.choices[0].token_ids)) if a != b), None)
    assert n is None or gaps[n] < 1e-3, f"differs from plain decoding at token {n}"
    assert (
        "".join(
            ch.choices[0].delta.content or "" for ch in client.chat.completions.create(stream=True, **kw) if ch.choices
        )
        == long.choices[0].message.content
    )


def test_predicted_outputs(client, server):
    """OpenAI's `prediction`: drafts come from it (tau rises), the text does not change, and usage
    reports accepted / rejected prediction tokens."""
    ask = "Write a Python function that checks whether a number is prime, with a docstring"
    first = (
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": ask + "."}], max_tokens=80, temperature=0
        )
        .choices[0]
        .message.content
    )
    kw = dict(
        model=MODEL, messages=[{"role": "user", "content": ask + " and type hints."}], max_tokens=80, temperature=0
    )
    plain = client.chat.completions.with_raw_response.create(**kw).http_response.json()
    predicted = client.chat.completions.with_raw_response.create(
        prediction={"type": "content", "content": first}, **kw
    ).http_response.json()
    assert predicted["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert predicted["meta_info"]["spec_accept_length"] > plain["meta_info"]["spec_accept_length"] + 0.2
    details = ChatCompletion.model_validate(predicted).usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 10 and details.rejected_prediction_tokens >= 0
    assert "completion_tokens_details" not in plain["usage"]
    accepted = server.telemetry.metrics.prediction_tokens.labels(
        **server.telemetry._lab, result="accepted"
    )._value.get()
    assert accepted >= details.accepted_prediction_tokens  # the counter moved (with this request's at least)
    parts = [{"type": "text", "text": first[:20]}, {"type": "text", "text": first[20:]}]
    chunks = list(
        client.chat.completions.create(
            prediction={"type": "content", "content": parts}, stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == plain["choices"][0]["message"]["content"]
    )
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens == details.accepted_prediction_tokens


def test_tokenize_and_detokenize(server, client, smollm2_fp32):
    """/tokenize gives the ids a request runs with (a chat with tools counts as /v1/chat/completions
    counts it); /detokenize inverts it."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        one = c.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
        assert one == {
            "tokens": smollm2_fp32.encode("Hello world"),
            "count": len(smollm2_fp32.encode("Hello world")),
            "max_model_len": server.backend.max_context,
        }
        many = c.post("/v1/tokenize", json={"prompt": ["a b", "c"]}).json()
        assert many["tokens"] == [smollm2_fp32.encode("a b"), smollm2_fp32.encode("c")] and many["count"] == [
            len(x) for x in many["tokens"]
        ]
        messages = user("What is the weather in Paris?")
        chat = c.post("/tokenize", json={"messages": messages, "tools": WEATHER_TOOLS}).json()
        used = client.chat.completions.create(
            model=MODEL, messages=messages, tools=WEATHER_TOOLS, max_tokens=1, temperature=0
        ).usage.prompt_tokens
        assert chat["count"] == used and chat["tokens"][0] == smollm2_fp32.encode("<|im_start|>")[0]
        assert c.post("/detokenize", json={"tokens": one["tokens"]}).json() == {"text": "Hello world"}
        assert c.post("/v1/detokenize", json={"tokens": many["tokens"]}).json() == {"text": ["a b", "c"]}
        back = c.post("/detokenize", json={"tokens": chat["tokens"]}).json()["text"]
        assert (
            back.startswith("<|im_start|>system\n")
            and "get_weather" in back
            and back.endswith("<|im_start|>assistant\n")
        )


def test_continue_final_message(server, client, smollm2_fp32):
    """continue_final_message: the reply continues the last assistant message (a prefilled answer), i.e.
    it is the completion of the template rendered up to inside that message."""
    messages = user("Name three colors.") + [{"role": "assistant", "content": "1. Red\n2."}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_body={"continue_final_message": True}
    )
    text = smollm2_fp32.chat_prompt(messages, continue_final=True)
    assert text.endswith("<|im_start|>assistant\n1. Red\n2.")
    same = client.completions.create(model=MODEL, prompt=text, max_tokens=12, temperature=0)
    assert out.choices[0].message.content == same.choices[0].text and out.usage.prompt_tokens == len(
        smollm2_fp32.encode(text)
    )
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert (
            c.post("/tokenize", json={"messages": messages, "continue_final_message": True}).json()["count"]
            == out.usage.prompt_tokens
        )
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=user("hi"), max_tokens=2, extra_body={"continue_final_message": True}
        )
    assert e.value.body["param"] == "messages"


WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
]


def streamed_reply(stream) -> tuple[str, list, str]:
    """(content, [(name, arguments)], finish_reason) joined from a chat stream."""
    content, calls, finish = "", [], None
    for ch in stream:
        for c in ch.choices:
            content += c.delta.content or ""
            calls += [(t.function.name, t.function.arguments) for t in c.delta.tool_calls or ()]
            finish = c.finish_reason or finish
    return content, calls, finish


def test_tool_calls(server, client, smollm2_fp32):
    """tools / tool_choice: a required or named call is schema-valid and is plain constrained greedy
    decoding of the rendered prompt (drafts included); streamed == not; calls the model writes itself
    (here forced by a regex under "auto") are parsed; a conversation with tool results is served."""
    from serving.api.tools import call_grammar, parse_tools, render_messages

    calls_counter = server.telemetry.metrics.tool_calls.labels(**server.telemetry._lab)
    calls_before, seen = calls_counter._value.get(), 0
    messages = user("What is the weather in Paris?")
    kw = dict(model=MODEL, messages=messages, tools=WEATHER_TOOLS, max_tokens=60, temperature=0)
    for choice, allowed, parallel in (
        ("required", {"get_weather", "get_time"}, False),
        ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}, True),
    ):
        out = client.chat.completions.create(
            tool_choice=choice, parallel_tool_calls=parallel, extra_body={"return_token_ids": True}, **kw
        )
        c = out.choices[0]
        assert parallel or c.finish_reason == "tool_calls"  # one call, then the grammar ends the reply
        if c.finish_reason == "length":  # calls until cut off: nothing lost, the text comes back as content
            assert c.message.content.startswith("<tool_call>\n") and c.message.tool_calls is None
        else:
            assert (c.finish_reason, c.message.content) == ("tool_calls", None) and len(c.message.tool_calls) >= 1
            assert parallel or len(c.message.tool_calls) == 1
        for call in c.message.tool_calls or ():
            args = json.loads(call.function.arguments)
            assert call.type == "function" and call.function.name in allowed and isinstance(args["city"], str)
            assert set(args) <= {"city", "unit"} and args.get("unit", "celsius") in ("celsius", "fahrenheit")
        tools = parse_tools(WEATHER_TOOLS, choice, None)
        chosen = [f for f in tools.functions if f.name in allowed]
        sp = SamplingParams(grammar=GrammarSpec("ebnf", call_grammar(chosen, parallel)))
        ref, gaps = reference_greedy(
            smollm2_fp32.model,
            smollm2_fp32.encode_chat(render_messages(messages, tools)),
            sp,
            60,
            server.engine.grammars,
            server.engine.eos_ids,
        )
        n = next((i for i, (a, b) in enumerate(zip(ref, c.token_ids)) if a != b), None)
        assert n is None or gaps[n] < 1e-3, f"differs from plain constrained decoding at token {n}"
        if c.finish_reason == "tool_calls":
            assert len(c.token_ids) == len(ref)
        content, calls, finish = streamed_reply(
            client.chat.completions.create(tool_choice=choice, parallel_tool_calls=parallel, stream=True, **kw)
        )
        assert (content or None, calls, finish) == (
            c.message.content,
            [(t.function.name, t.function.arguments) for t in c.message.tool_calls or ()],
            c.finish_reason,
        )
        seen += 2 * len(calls)
    # "auto": calls the model writes are parsed, with the content before them
    forced = 'Checking\\.\n<tool_call>\n\\{"name": "get_time", "arguments": \\{"city": "Oslo"\\}\\}\n</tool_call>'
    out = client.chat.completions.create(extra_body={"regex": forced}, **kw).choices[0]
    assert (out.message.content, out.finish_reason) == ("Checking.\n", "tool_calls")
    assert [(t.function.name, json.loads(t.function.arguments)) for t in out.message.tool_calls] == [
        ("get_time", {"city": "Oslo"})
    ]
    assert streamed_reply(client.chat.completions.create(extra_body={"regex": forced}, stream=True, **kw))[0::2] == (
        "Checking.\n",
        "tool_calls",
    )
    assert (
        calls_counter._value.get() - calls_before == seen + 2
    )  # every call returned, streamed or not (+ the forced pair)
    # a conversation with a call and its result: the model sees the rendered history
    history = messages + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18, "sky": "cloudy"}'},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=history, tools=WEATHER_TOOLS, max_tokens=30, temperature=0
    )
    rendered = render_messages(
        [
            messages[0],
            messages[1],
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}],
            },
            {"role": "tool", "content": history[-1]["content"]},
        ],
        parse_tools(WEATHER_TOOLS, None, None),
    )
    assert answer.usage.prompt_tokens == len(smollm2_fp32.encode_chat(rendered))
    assert isinstance(answer.choices[0].message.content, str) or answer.choices[0].message.tool_calls
    # tool_choice "none": plain text, the same as without tools
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    none = client.chat.completions.create(tool_choice="none", **{**kw, "max_tokens": 20})
    assert (
        none.choices[0].message.content == plain.choices[0].message.content
        and none.choices[0].message.tool_calls is None
    )


TOPICS = [
    "cats",
    "rain",
    "the moon",
    "bread",
    "music",
    "rivers",
    "chess",
    "winter",
    "bees",
    "glass",
    "trains",
    "salt",
    "clouds",
    "paper",
    "islands",
    "owls",
    "copper",
    "tea",
    "deserts",
    "maps",
    "violins",
    "snow",
    "bridges",
    "apples",
    "stars",
    "wool",
    "volcanoes",
    "clocks",
    "rice",
    "whales",
    "kites",
    "ink",
]


def test_32_concurrent_streams_equal_each_alone(server, client, smollm2_fp32):
    """Batching does not change greedy outputs (fp32; a divergence is allowed only at a numerical tie)."""
    msgs = [user(f"One fact about {t}.") for t in TOPICS]
    kw = dict(model=MODEL, max_tokens=10, temperature=0, extra_body={"return_token_ids": True})
    alone = [client.chat.completions.create(messages=m, **kw).choices[0] for m in msgs]
    hist = server.telemetry.batch_size
    big_before = hist._sum.get()

    def stream(m):
        text, ids = "", None
        for ch in client.chat.completions.create(messages=m, stream=True, **kw):
            for c in ch.choices:
                text += c.delta.content or ""
                ids = getattr(c, "token_ids", None) or ids
        return text, ids

    with cf.ThreadPoolExecutor(32) as pool:
        together = list(pool.map(stream, msgs))
    verdicts = []
    for m, a, (text, ids) in zip(msgs, alone, together):
        v = compare_to_reference(smollm2_fp32.model, smollm2_fp32.encode_chat(m), a.token_ids, ids)
        verdicts.append(v)
        if v == "same":
            assert text == a.message.content
    print(f"32 streams: {verdicts.count('same')} same, {verdicts.count('tie')} numerical ties")
    assert "bug" not in verdicts, verdicts
    assert hist._sum.get() - big_before > 10 * 16, "the 32 streams were not batched together"


def test_50_dropped_streams_free_their_kv(server):
    engine, engine_loop = server.engine, server.backend.engine_loop
    assert slots_whole(engine) and engine_loop.load() == (0, 0)
    aborted0 = server.telemetry._requests["aborted"]._value.get()

    async def open_and_drop(c, i):
        req = {
            "model": MODEL,
            "messages": user(f"Tell a long story about {TOPICS[i % 32]}."),
            "max_tokens": 64,
            "temperature": 0,
            "stream": True,
        }
        async with c.stream("POST", CHAT, json=req) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if '"content"' in line and '"role"' not in line:
                    return  # one content delta, then hang up mid-stream

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=httpx.Limits(max_connections=64)) as c:
            await asyncio.gather(*(open_and_drop(c, i) for i in range(50)))

    asyncio.run(main())
    deadline = time.monotonic() + 60
    while (not slots_whole(engine) or engine_loop.load() != (0, 0)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert slots_whole(engine) and engine_loop.load() == (0, 0) and not engine.has_work
    assert server.telemetry._requests["aborted"]._value.get() - aborted0 == 50
    _, values = _scrape(server.url)  # and the KV gauges say so
    assert (values["moa_kv_cache_used_tokens"], values["moa_kv_cache_reserved_tokens"]) == (0, 0)


def test_kv_cache_gauges_follow_a_request(server, monkeypatch):
    engine = server.engine
    _, idle = _scrape(server.url)
    assert idle["moa_kv_cache_capacity_tokens"] == engine.kv.num_slots - 1
    assert (idle["moa_kv_cache_used_tokens"], idle["moa_kv_cache_reserved_tokens"]) == (0, 0)
    req = {
        "model": MODEL,
        "messages": user("Tell a long story about a lighthouse."),
        "max_tokens": 200,
        "temperature": 0,
        "stream": True,
    }
    prompt = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": req["messages"]}).json()["count"]
    # NOTE: the engine thread is held after the first step whose KV holds the prompt and some output,
    # so the scrape sees the request mid-flight however fast the machine is (without the hold a fast
    # engine finished all 200 tokens before the client's scrape). The timeouts only stop a hang.
    held, release = threading.Event(), threading.Event()
    real_step = engine.step

    def step_then_hold():
        events = real_step()
        if not held.is_set() and engine.running and len(engine.running[0].slots) > prompt:
            held.set()
            release.wait(timeout=300)
        return events

    monkeypatch.setattr(engine, "step", step_then_hold)
    try:
        with httpx.stream("POST", server.url + CHAT, json=req, timeout=300) as r:
            assert held.wait(timeout=300), "the request ended before its KV held any output"
            _, busy = _scrape(server.url)
            release.set()
            body = "".join(r.iter_lines())
    finally:
        release.set()
    tree = engine.tree.num_draft_tokens + 1
    assert prompt < busy["moa_kv_cache_used_tokens"] < prompt + 200 + tree
    assert busy["moa_kv_cache_reserved_tokens"] == prompt + 200 + tree
    # a finished request's KV is freed and its reservation dropped before its last chunk is sent
    assert "[DONE]" in body
    _, after = _scrape(server.url)
    assert (after["moa_kv_cache_used_tokens"], after["moa_kv_cache_reserved_tokens"]) == (0, 0)


def _scrape(url: str) -> tuple[str, dict]:
    text = httpx.get(url + "/metrics").text
    values = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + (
                "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("drafter", "backend")) + "}"
                if len(s.labels) > 2
                else ""
            )
            values[key] = values.get(key, 0) + s.value
    return text, values


def test_metrics_promtool_and_counters_move(server, client, tmp_path):
    _, before = _scrape(server.url)
    client.chat.completions.create(
        model=MODEL, messages=user("Repeat: one two three one two three one two three"), max_tokens=16, temperature=0
    )
    text, after = _scrape(server.url)
    for name in (
        "moa_verify_steps_total",
        "moa_draft_tokens_total",
        "moa_generated_tokens_total",
        "moa_prompt_tokens_total",
        "moa_requests_total{status=ok}",
        "moa_time_to_first_token_seconds_count",
        "moa_inter_token_latency_seconds_count",
        "moa_request_latency_seconds_count",
        "moa_batch_size_count",
        "moa_accept_length_count",
        "moa_draft_tokens_per_step_count",
    ):
        assert after[name] > before.get(name, 0), name
    assert after["moa_accepted_tokens_total"] >= before["moa_accepted_tokens_total"]
    assert any(v > 0 for k, v in after.items() if k.startswith("moa_throughput_tokens_per_second"))
    assert 'backend="embedded"' in text and f'drafter="{DRAFTER}"' in text
    promtool = shutil.which("promtool") or str(Path(__file__).resolve().parents[2] / ".tools/bin/promtool")
    if not Path(promtool).exists():
        pytest.skip("promtool not installed (scripts/install-deploy-tools.sh)")
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_serving_doc_example_runs(server):
    """docs/SERVING.md's openai-client example runs as written (against this server)."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "SERVING.md").read_text()
    code = re.search(r"```python\n(from openai import OpenAI.*?)```", doc, re.S).group(1)
    ns: dict = {}
    exec(compile(code.replace("http://127.0.0.1:8000/v1", server.url + "/v1"), "docs/SERVING.md", "exec"), ns)
    assert ns["r"].choices[0].message.tool_calls[0].function.name == "get_weather"
