"""SGLang's native POST /generate on the gateway: a real server on 127.0.0.1, the shapes SGLang 0.5.23 returns,
the same text as /v1/completions, streaming, batches, n, structured output, and clear 400s."""

from __future__ import annotations

import json

import httpx
import pytest

from serving.config import EngineConfig
from serving.engine import Engine
from serving.gateway.app import create_app
from serving.gateway.server import ServerThread, embedded_backend
from sglang_ext.drafters import default_tree, make_drafter

MODEL, DRAFTER = "smollm2", "suffix"
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def server(smollm2_fp32):
    engine = Engine(
        smollm2_fp32, make_drafter(DRAFTER, smollm2_fp32), EngineConfig(tree=default_tree(DRAFTER), kv_slots=8192)
    )
    backend, telemetry = embedded_backend(engine, MODEL, DRAFTER)
    with ServerThread(create_app(backend, telemetry)) as srv:
        srv.engine = engine
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


def greedy(max_new_tokens=16, **extra):
    return {"temperature": 0, "max_new_tokens": max_new_tokens, **extra}


def events(resp: httpx.Response) -> list[dict]:
    lines = [ln[len("data: ") :] for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_generate_matches_completions_and_sglang_shape(server, http, smollm2_fp32):
    out = http.post("/generate", json={"text": PROMPT, "sampling_params": greedy()}).json()
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 16} and meta["completion_tokens"] == 16 == len(
        out["output_ids"]
    )
    assert (
        meta["prompt_tokens"] == len(smollm2_fp32.encode(PROMPT))
        and meta["cached_tokens"] == 0
        and meta["e2e_latency"] > 0
    )
    assert meta["spec_verify_ct"] >= 1 and meta["spec_num_proposed_drafts"] == meta["spec_draft_tokens"]
    assert smollm2_fp32.tokenizer.decode(out["output_ids"], skip_special_tokens=True) == out["text"]
    openai = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    ).json()
    assert out["text"] == openai["choices"][0]["text"]
    by_ids = http.post("/generate", json={"input_ids": smollm2_fp32.encode(PROMPT), "sampling_params": greedy()}).json()
    assert by_ids["text"] == out["text"] and by_ids["output_ids"] == out["output_ids"]


def test_generate_batches_n_and_per_prompt_params(http):
    prompts = [PROMPT, "def fibonacci(n):"]
    outs = http.post("/generate", json={"text": prompts, "sampling_params": greedy(8)}).json()
    alone = [http.post("/generate", json={"text": p, "sampling_params": greedy(8)}).json() for p in prompts]
    assert [o["text"] for o in outs] == [a["text"] for a in alone]
    per_prompt = http.post("/generate", json={"text": prompts, "sampling_params": [greedy(4), greedy(8)]}).json()
    assert [o["meta_info"]["completion_tokens"] for o in per_prompt] == [4, 8]
    sampled = http.post(
        "/generate",
        json={
            "text": PROMPT,
            "sampling_params": {"n": 3, "temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 7},
        },
    ).json()
    assert isinstance(sampled, list) and len(sampled) == 3
    again = http.post(
        "/generate",
        json={
            "text": PROMPT,
            "sampling_params": {"n": 3, "temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 7},
        },
    ).json()
    assert [o["text"] for o in again] == [o["text"] for o in sampled]  # seeded: reproducible


def test_generate_stream_is_cumulative_and_ends_like_the_whole(server, http):
    body = {"text": PROMPT, "sampling_params": greedy(24), "stream": True}
    with http.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        evs = events(r)
    whole = http.post("/generate", json={**body, "stream": False}).json()
    texts = [e["text"] for e in evs]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), "SGLang streams the text so far"
    assert all(e["meta_info"]["finish_reason"] is None for e in evs[:-1])
    assert evs[-1]["text"] == whole["text"] and evs[-1]["output_ids"] == whole["output_ids"]
    assert evs[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    assert all(e["output_ids"] == evs[-1]["output_ids"][: len(e["output_ids"])] for e in evs)
    with http.stream(
        "POST", "/generate", json={"text": [PROMPT, "Hello"], "sampling_params": greedy(6), "stream": True}
    ) as r:
        batch = events(r)
    assert {e["index"] for e in batch} == {0, 1}
    assert [e["meta_info"]["finish_reason"] is not None for e in batch].count(True) == 2


def test_generate_logprobs_sglang_shape(http, smollm2_fp32):
    """return_logprob: [logprob, id, text or None] per output token (the same numbers as /v1/completions'
    logprobs), top_logprobs_num alternatives per token, texts with return_text_in_logprobs, and a stream
    that ends with the same lists."""
    body = {"text": PROMPT, "sampling_params": greedy(12), "return_logprob": True, "top_logprobs_num": 3}
    out = http.post("/generate", json=body).json()
    meta = out["meta_info"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"] and meta["input_token_logprobs"] == []
    assert all(text is None for _, _, text in meta["output_token_logprobs"])
    assert [len(top) for top in meta["output_top_logprobs"]] == [3] * 12
    assert all(top[0][0] >= top[1][0] >= top[2][0] for top in meta["output_top_logprobs"])
    assert all(
        abs(lp - top[0][0]) < 1e-5
        for (lp, _, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"])
    )  # greedy: the top one
    ref = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 3}
    ).json()
    assert [round(lp, 4) for lp, _, _ in meta["output_token_logprobs"]] == [
        round(x, 4) for x in ref["choices"][0]["logprobs"]["token_logprobs"]
    ]
    texts = http.post("/generate", json={**body, "return_text_in_logprobs": True}).json()["meta_info"][
        "output_token_logprobs"
    ]
    assert "".join(t for _, _, t in texts) == out["text"]
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        last = events(r)[-1]
    assert last["meta_info"]["output_token_logprobs"] == meta["output_token_logprobs"]
    assert "output_top_logprobs" not in http.post("/generate", json={**body, "top_logprobs_num": 0}).json()["meta_info"]


def test_generate_prompt_logprobs_from_logprob_start_len(http, smollm2_fp32):
    """logprob_start_len i >= 0: the prompt's logprobs from position i (the first token's null), the same
    numbers as /v1/completions echo; no echoed text; with max_new_tokens 0 (how sgl.select scores)."""
    ids = smollm2_fp32.encode(PROMPT)
    ref = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2}
    ).json()
    ref_lps = ref["choices"][0]["logprobs"]["token_logprobs"]
    for start in (0, 2):
        out = http.post(
            "/generate",
            json={
                "text": PROMPT,
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "return_text_in_logprobs": True,
                "logprob_start_len": start,
                "top_logprobs_num": 2,
            },
        ).json()
        meta = out["meta_info"]
        assert out["text"] == "" and [t for _, t, _ in meta["input_token_logprobs"]] == ids[start:]
        assert [None if lp is None else round(lp, 4) for lp, _, _ in meta["input_token_logprobs"]] == [
            None if x is None else round(x, 4) for x in ref_lps[start:]
        ]
        assert "".join(t for _, _, t in meta["input_token_logprobs"]) == smollm2_fp32.tokenizer.decode(ids[start:])
        assert (meta["input_top_logprobs"][0] is None) == (start == 0) and all(
            len(t) == 2 for t in meta["input_top_logprobs"][1:]
        )
    out = http.post(
        "/generate", json={"text": PROMPT, "sampling_params": greedy(4), "return_logprob": True, "logprob_start_len": 1}
    ).json()
    plain = http.post("/generate", json={"text": PROMPT, "sampling_params": greedy(4)}).json()
    assert out["text"] == plain["text"] and len(out["meta_info"]["input_token_logprobs"]) == len(ids) - 1
    assert len(out["meta_info"]["output_token_logprobs"]) == 4


def test_generate_stop_and_json_schema(http):
    out = http.post("/generate", json={"text": "1, 2, 3, 4,", "sampling_params": greedy(32, stop=[" 7"])}).json()
    assert " 7" not in out["text"] and out["meta_info"]["finish_reason"]["type"] == "stop", out
    schema = {
        "type": "object",
        "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
        "required": ["color"],
    }
    out = http.post(
        "/generate", json={"text": "A color as JSON: ", "sampling_params": greedy(32, json_schema=json.dumps(schema))}
    ).json()
    assert json.loads(out["text"])["color"] in ("red", "green", "blue")


@pytest.mark.parametrize(
    "body,param",
    [
        ({"sampling_params": greedy()}, "text"),
        ({"text": "a", "input_ids": [1, 2]}, "text"),
        ({"text": []}, "text"),
        ({"input_ids": [[1, 2], "x"]}, "input_ids"),
        ({"text": "a", "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
        ({"text": "a", "sampling_params": {"min_p": 0.1}}, "sampling_params.min_p"),
        ({"text": "a", "sampling_params": {"max_new_tokens": 10**6}}, "sampling_params.max_new_tokens"),
        ({"text": "a", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"text": "a", "sampling_params": {"stop": [""]}}, "sampling_params.stop"),
        ({"text": "a", "sampling_params": {"json_schema": "{not json"}}, "sampling_params.json_schema"),
        ({"text": "a", "sampling_params": {"json_schema": "{}", "regex": "a+"}}, "sampling_params.json_schema"),
        ({"text": ["a", "b"], "sampling_params": [greedy()]}, "sampling_params"),
        ({"text": "a", "sampling_params": {"n": 100}}, "sampling_params.n"),
        ({"text": "a", "return_logprob": True, "logprob_start_len": -5}, "logprob_start_len"),
        ({"text": "a", "return_logprob": True, "top_logprobs_num": 50}, "top_logprobs_num"),
        ({"text": "a", "return_logprob": "yes"}, "return_logprob"),
        ({"text": "a", "image_data": "http://x/y.png"}, "image_data"),
        ({"text": "a", "stream": "yes"}, "stream"),
        ({"text": "a", "cache_salt": 5}, "cache_salt"),
        ({"text": "a", "cache_salt": "s" * 257}, "cache_salt"),
        ({"text": "a", "cache_salt": ""}, "cache_salt"),
    ],
)
def test_generate_bad_requests(http, body, param):
    r = http.post("/generate", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err
    assert http.post("/generate", json={"text": "a", "sampling_params": greedy(2)}).status_code == 200  # still serving


def test_generate_not_json(http):
    r = http.post("/generate", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"]


def test_the_body_sglang_bench_serving_sends(http):
    """sglang.bench_serving --backend sglang (sglang 0.5.23, benchmark/serving.py
    async_request_sglang_generate) posts this body and reads the stream this way: cumulative "text",
    meta_info.completion_tokens as the output length, meta_info.spec_accept_length when present."""
    payload = {
        "text": PROMPT,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 20, "ignore_eos": True},
        "stream": True,
        "lora_path": None,
        "return_logprob": False,
        "return_routed_experts": False,
        "logprob_start_len": -1,
    }
    generated, output_len, accept_length, chunks = "", 0, None, 0
    with http.stream("POST", "/generate", json=payload) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            data = line.strip()
            if not data:
                continue
            data = data[6:] if data.startswith("data: ") else data
            if data == "[DONE]":
                continue
            obj = json.loads(data)
            accept_length = (obj.get("meta_info") or {}).get("spec_accept_length", accept_length)
            if obj.get("text"):
                generated, output_len, chunks = obj["text"], obj["meta_info"]["completion_tokens"], chunks + 1
    assert output_len == 20 and generated and chunks >= 2 and accept_length is not None and accept_length >= 1


def test_sglang_frontend_language_runs_against_the_gateway(server, http):
    """SGLang's own client (sglang.lang RuntimeEndpoint: /get_model_info, /generate with its full sampling
    dict and max_new_tokens 0 prefix caching, streaming, select by prompt logprobs) runs programs against
    the gateway; its greedy answer is /generate's."""
    import sglang as sgl

    backend = sgl.RuntimeEndpoint(server.url)
    assert backend.get_model_name() == MODEL
    backend.cache_prefix(PROMPT)  # max_new_tokens 0

    @sgl.function
    def colors(s):
        s += PROMPT + sgl.gen("answer", max_tokens=16, temperature=0)

    state = colors.run(backend=backend)
    expected = http.post("/generate", json={"text": PROMPT, "sampling_params": greedy(16)}).json()["text"]
    assert state["answer"] == expected
    streamed = colors.run(backend=backend, stream=True)
    assert "".join(streamed.text_iter("answer")) == expected
    assert backend.get_server_info()["internal_states"][0]["avg_spec_accept_length"] >= 1  # after those requests
    backend.flush_cache()

    @sgl.function
    def pick(s):  # sgl.select scores each choice by the prompt logprobs of prefix + choice
        s += "Q: What color is the sky on a clear day?\nA: The sky is" + sgl.select(
            "color", choices=[" blue", " green", " purple"]
        )

    state = pick.run(backend=backend)
    assert state["color"] in (" blue", " green", " purple")
    meta = state.get_meta_info("color")
    assert (
        len(meta["normalized_prompt_logprobs"]) == 3
        and state["color"]
        == [" blue", " green", " purple"][max(range(3), key=meta["normalized_prompt_logprobs"].__getitem__)]
    )


def test_generate_max_new_tokens_0_is_prefill_only(http, smollm2_fp32):
    out = http.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 0}}).json()
    assert (
        out["text"] == ""
        and out["output_ids"] == []
        and out["meta_info"]["prompt_tokens"] == len(smollm2_fp32.encode(PROMPT))
    )
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    # what SGLang clients send it for: the prompt is now cached, and a request starting with it prefills the rest
    again = http.post("/generate", json={"text": PROMPT + " Go on.", "sampling_params": greedy(2)}).json()
    assert again["meta_info"]["cached_tokens"] >= len(smollm2_fp32.encode(PROMPT)) - 2  # (the last token may merge)
