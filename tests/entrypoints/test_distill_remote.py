"""`moa-serve distill --base-url`: the target's answers through a running server, our own gateway on loopback
(a real uvicorn server), behind a middleware that fails chosen requests the ways servers fail: 503, a crash
(500), a connection dropped halfway through an answer, 404 on /generate (a server without SGLang's API) and a
400 that refuses one prompt."""

from __future__ import annotations

import json

import pytest

from moa_serve.entrypoints.cli import main as cli_main
from serving.config import EngineConfig
from serving.engine import Engine
from serving.gateway.app import create_app
from serving.gateway.server import ServerThread, embedded_backend
from sglang_ext.sampling import SamplingParams
from sglang_ext.training.shards import load_examples_by_source

QUESTIONS = [
    "Name three primary colors.",
    "What is 7 times 8?",
    "Write a haiku about rain.",
    "Define entropy in one sentence.",
]
NEW_TOKENS = 12


class Flaky:
    """ASGI middleware: the n-th completion request (1-based, /generate or chat) gets plan[n] instead of its
    answer, and every /generate request plan["/generate"]: an HTTP status, "crash" (the app raises: uvicorn
    answers 500) or "drop" (the answer is generated, then the connection is cut halfway through its body)."""

    PATHS = ("/generate", "/v1/chat/completions")

    def __init__(self, app):
        self.app, self.plan, self.n, self.faults = app, {}, 0, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in self.PATHS:
            return await self.app(scope, receive, send)
        self.n += 1
        fault = self.plan.get(self.n, self.plan.get(scope["path"]))
        if fault is None:
            return await self.app(scope, receive, send)
        self.faults.append(fault)
        if isinstance(fault, int):
            body = json.dumps({"error": {"message": f"injected {fault}", "type": "test"}}).encode()
            await send({"type": "http.response.start", "status": fault, "headers": [(b"content-type", b"json")]})
            return await send({"type": "http.response.body", "body": body})
        if fault == "crash":
            raise RuntimeError("injected crash")
        kept = []

        async def keep(message):
            kept.append(message)

        await self.app(scope, receive, keep)
        body = b"".join(m.get("body", b"") for m in kept if m["type"] == "http.response.body")
        await send(kept[0])  # its content-length promises the whole body
        await send({"type": "http.response.body", "body": body[: len(body) // 2], "more_body": True})
        raise RuntimeError("injected drop")


@pytest.fixture(scope="module")
def gateway(smollm2_fp32):
    engine = Engine(smollm2_fp32, None, EngineConfig(kv_slots=8192))
    backend, telemetry = embedded_backend(engine, "smollm2", "none")
    flaky = Flaky(create_app(backend, telemetry))
    with ServerThread(flaky) as srv:
        srv.flaky = flaky
        yield srv


@pytest.fixture
def flaky(gateway):
    gateway.flaky.plan, gateway.flaky.n, gateway.flaky.faults = {}, 0, []
    return gateway.flaky


@pytest.fixture(scope="module")
def generated(smollm2_fp32):
    """`moa-serve generate --drafter none --chat --json --dtype float32` token ids of each question."""
    import contextlib
    import io

    out = {}
    for i, q in enumerate(QUESTIONS):
        buf = io.StringIO()
        args = ["generate", "--prompt", q, "--chat", "--drafter", "none", "--json", "--max-new-tokens", str(NEW_TOKENS)]
        args += ["--dtype", "float32"]  # the gateway's engine runs the fp32 target
        with contextlib.redirect_stdout(buf):
            assert cli_main(args) == 0
        out[f"q{i}"] = json.loads(buf.getvalue())["token_ids"]
    return out


def _conversations(path):
    path.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"q{i}",
                    "conversations": [{"role": "user", "content": q}, {"role": "assistant", "content": "x"}],
                }
            )
            + "\n"
            for i, q in enumerate(QUESTIONS)
        )
    )
    return path


def _distill(gateway, tmp_path, *extra: str) -> int:
    args = ["distill", "--base-url", gateway.url, "--data", str(_conversations(tmp_path / "convs.jsonl"))]
    args += ["--out", str(tmp_path / "d.jsonl"), "--max-new-tokens", str(NEW_TOKENS), "--concurrency", "2"]
    return cli_main(args + ["--retry-backoff", "0.01", "--no-progress", "--num-conversations", "4", *extra])


def _records(tmp_path) -> dict[str, dict]:
    with open(tmp_path / "d.jsonl", encoding="utf-8") as f:
        recs = [json.loads(line) for line in f]
    assert len({r["id"] for r in recs}) == len(recs)  # never one prompt twice
    return {r["id"]: r for r in recs}


def test_answers_through_the_gateway_are_generates_token_ids(gateway, flaky, generated, smollm2_fp32, tmp_path):
    assert _distill(gateway, tmp_path, "--shards", str(tmp_path / "shards")) == 0
    recs = _records(tmp_path)
    assert sorted(recs) == sorted(generated) and flaky.faults == []
    for cid, rec in recs.items():
        q = rec["conversations"][0]["content"]
        assert rec["output_ids"] == generated[cid]
        assert rec["prompt_ids"] == smollm2_fp32.encode_chat([{"role": "user", "content": q}])
        text = smollm2_fp32.tokenizer.decode(generated[cid], skip_special_tokens=True).strip()
        assert rec["conversations"][1] == {"role": "assistant", "content": text}
    (name, examples), *rest = load_examples_by_source(tmp_path / "shards", max_len=4096).items()
    assert name == "distill:d" and not rest and len(examples) == 4
    by_ids = {tuple(r["prompt_ids"] + r["output_ids"]): r for r in recs.values()}
    for ex in examples:  # each answer behind its prompt, the loss mask on the answer
        rec = by_ids[tuple(ex.input_ids.tolist())]
        assert ex.loss_mask.tolist() == [False] * len(rec["prompt_ids"]) + [True] * len(rec["output_ids"])


def test_a_server_that_fails_mid_run_loses_no_prompt(gateway, flaky, generated, tmp_path):
    flaky.plan = {2: 503, 3: "drop", 5: "crash", 6: 503}
    assert _distill(gateway, tmp_path) == 0
    assert sorted(flaky.faults, key=str) == [503, 503, "crash", "drop"]
    assert {cid: r["output_ids"] for cid, r in _records(tmp_path).items()} == generated


def test_a_server_that_stays_down_stops_the_run_and_resume_finishes_it(gateway, flaky, generated, tmp_path, capsys):
    flaky.plan = {n: 503 for n in range(3, 100)}
    assert _distill(gateway, tmp_path, "--max-retries", "2") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("moa-serve distill: error: ") and "failed 3 times; last: POST /generate: HTTP 503" in err
    assert "rerun with --resume" in err
    first = _records(tmp_path)
    assert len(first) == 2
    flaky.plan = {}
    assert _distill(gateway, tmp_path, "--resume") == 0
    recs = _records(tmp_path)
    assert {cid: r["output_ids"] for cid, r in recs.items()} == generated


def test_a_refused_prompt_is_reported_and_retried_on_resume(gateway, flaky, generated, tmp_path, capsys):
    flaky.plan = {1: 400}
    assert _distill(gateway, tmp_path, "--concurrency", "1") == 0
    err = capsys.readouterr().err
    assert "prompt q0 refused by the server: HTTP 400: injected 400" in err and "1 prompts refused" in err
    assert sorted(_records(tmp_path)) == ["q1", "q2", "q3"]
    assert _distill(gateway, tmp_path, "--resume") == 0
    assert {cid: r["output_ids"] for cid, r in _records(tmp_path).items()} == generated


def test_without_generate_the_chat_api_answers_and_the_text_is_retokenized(gateway, flaky, smollm2_fp32, tmp_path):
    """A server without /generate (vLLM, OpenAI): chat completions, and the answers re-tokenized with the
    target's tokenizer and chat template."""
    flaky.plan = {"/generate": 404}
    assert _distill(gateway, tmp_path) == 0
    assert flaky.faults in ([404], [404, 404])  # asked once per request in flight, then chat for every prompt
    tok = smollm2_fp32.tokenizer
    for rec in _records(tmp_path).values():
        msgs = rec["conversations"]
        assert rec["prompt_ids"] == smollm2_fp32.encode_chat(msgs[:1])
        rendered = tok.apply_chat_template(msgs, tokenize=False) if rec["finish_reason"] == "stop" else None
        if rendered is not None:
            assert rec["prompt_ids"] + rec["output_ids"] == tok.encode(rendered, add_special_tokens=False)
        assert tok.decode(rec["output_ids"], skip_special_tokens=True).strip() == msgs[1]["content"]


def test_later_turns_and_samples_through_the_gateway(gateway, flaky, smollm2_fp32, tmp_path):
    """--turns 2 --samples 2 through a server: each turn 2 after its own dialogue's first answer, every
    sample sent with its own seed (the server's answers to the same prompt and seed are reproducible)."""
    src = tmp_path / "two.jsonl"
    turns = [{"role": "user", "content": QUESTIONS[1]}, {"role": "assistant", "content": "x"}]
    turns += [{"role": "user", "content": "And 8 times 9?"}, {"role": "assistant", "content": "y"}]
    src.write_text(json.dumps({"id": "m", "conversations": turns}) + "\n")
    args = ["distill", "--base-url", gateway.url, "--data", str(src), "--out", str(tmp_path / "d.jsonl")]
    args += ["--max-new-tokens", "6", "--turns", "2", "--samples", "2", "--temperature", "0.9", "--seed", "3"]
    assert cli_main(args + ["--no-progress", "--retry-backoff", "0.01"]) == 0
    with open(tmp_path / "d.jsonl", encoding="utf-8") as f:
        recs = {(r["sample"], r["turn"]): r for r in map(json.loads, f)}
    assert sorted(recs) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    for s in (0, 1):
        ctx = recs[(s, 1)]["conversations"] + [{"role": "user", "content": "And 8 times 9?"}]
        assert recs[(s, 2)]["prompt_ids"] == smollm2_fp32.encode_chat(ctx)
    engine = Engine(smollm2_fp32, None, EngineConfig(kv_slots=1024))
    for (s, _), r in recs.items():
        params = SamplingParams(max_new_tokens=6, temperature=0.9, seed=3 + s)
        assert r["output_ids"] == list(engine.generate([r["prompt_ids"]], params)[0].output_ids)
