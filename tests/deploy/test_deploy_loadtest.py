"""loadtest/chat.py under a real headless locust run, against a small OpenAI-shaped streaming server on
127.0.0.1 (a stand-in until the live-gateway test exists; see deploy/README.md)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from deploytools import ROOT, find_tool

MODEL, API_KEY, MAX_TOKENS = "stub-model", "sk-test", 5
PROMPT = "only prompt"


class OpenAIStreamHandler(BaseHTTPRequestHandler):
    """GET /v1/models and streaming POST /v1/chat/completions (SSE, usage chunk, [DONE]), the body either
    chunked (as uvicorn sends it) or close-delimited. Anything a correct client would not send (wrong key,
    model, prompt, max_tokens) gets a 400/401."""

    protocol_version = "HTTP/1.1"
    chunked = True

    def log_message(self, *args):
        pass

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        if self.headers.get("authorization") == f"Bearer {API_KEY}":
            return True
        self._json(401, {"error": {"message": "bad key", "type": "auth", "param": None, "code": None}})
        return False

    def do_GET(self):
        if self._authorized():
            self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    def expected(self, req: dict) -> bool:
        return (req["model"], req["messages"], req["max_tokens"], req["stream"]) == (
            MODEL,
            [{"role": "user", "content": PROMPT}],
            MAX_TOKENS,
            True,
        )

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if not self._authorized():
            return
        if not self.expected(req):
            return self._json(400, {"error": {"message": f"unexpected request {req}", "type": "invalid_request_error"}})
        self.prompt_messages = len(req["messages"])
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        if self.chunked:
            self.send_header("transfer-encoding", "chunked")
        else:
            self.send_header("connection", "close")
            self.close_connection = True
        self.end_headers()
        try:
            for i in range(MAX_TOKENS):
                time.sleep(0.01)
                self._event(
                    {
                        "object": "chat.completion.chunk",
                        "model": MODEL,
                        "choices": [{"index": 0, "delta": {"content": f"w{i} "}, "finish_reason": None}],
                    }
                )
            self._event(
                {
                    "object": "chat.completion.chunk",
                    "model": MODEL,
                    "choices": [],
                    "usage": {
                        "prompt_tokens": 2,
                        "completion_tokens": MAX_TOKENS,
                        "total_tokens": MAX_TOKENS + 2,
                        "prompt_tokens_details": {"cached_tokens": self.prompt_messages},
                    },
                }
            )
            self._chunk(b"data: [DONE]\n\n")
            if self.chunked:
                self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):  # locust stops users mid-stream at the end of the run
            pass

    def _event(self, obj: dict) -> None:
        self._chunk(f"data: {json.dumps(obj)}\n\n".encode())

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data)
        self.wfile.flush()


@pytest.fixture(params=["chunked", "close-delimited"])
def stream_server(request):
    handler = type("Handler", (OpenAIStreamHandler,), {"chunked": request.param == "chunked"})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_headless_locust_records_stream_metrics(stream_server, tmp_path):
    locust = find_tool("locust")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "turns": [PROMPT, "second turn"]}) + "\n")
    env = {
        **os.environ,
        "MOA_LOADTEST_HOST": stream_server,
        "MOA_LOADTEST_API_KEY": API_KEY,
        "MOA_LOADTEST_MAX_TOKENS": str(MAX_TOKENS),
        "MOA_LOADTEST_PROMPTS": str(prompts),
    }
    env.pop("MOA_LOADTEST_MODEL", None)  # discovered through GET /v1/models
    proc = subprocess.run(
        [
            locust,
            "-f",
            str(ROOT / "loadtest" / "chat.py"),
            "--headless",
            "-u",
            "2",
            "-r",
            "2",
            "-t",
            "3s",
            "--csv",
            str(tmp_path / "run"),
            "--only-summary",
            "--exit-code-on-error",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(open(tmp_path / "run_stats.csv"))}
    assert int(rows[("", "Aggregated")]["Failure Count"]) == 0
    requests = int(rows[("POST", "/v1/chat/completions (stream)")]["Request Count"])
    assert requests > 0
    metric = {name: rows[("METRIC", name)] for name in ("ttft_ms", "itl_ms", "e2e_ms", "output_tokens")}
    assert int(metric["ttft_ms"]["Request Count"]) == int(metric["e2e_ms"]["Request Count"]) >= requests - 2
    assert int(metric["itl_ms"]["Request Count"]) >= (MAX_TOKENS - 1) * int(metric["ttft_ms"]["Request Count"])
    assert float(metric["output_tokens"]["Average Response Time"]) == MAX_TOKENS
    # The server spaces tokens 10 ms apart: the client must see those gaps, not 0 (tokens merged by buffering).
    assert float(metric["itl_ms"]["Median Response Time"]) >= 8
    assert float(metric["e2e_ms"]["Average Response Time"]) >= MAX_TOKENS * 10


ANSWER = "".join(f"w{i} " for i in range(MAX_TOKENS))  # what the stand-in streams


class MultiTurnHandler(OpenAIStreamHandler):
    """Accepts a conversation: the system prompt, then turns of the prompt and this server's own answer, then the
    prompt; records each request's message count."""

    counts: list[int] = []

    def expected(self, req: dict) -> bool:
        msgs = req["messages"]
        turns = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": ANSWER}]
        ok = msgs[0] == {"role": "system", "content": "be brief"} and all(
            m == turns[i % 2] for i, m in enumerate(msgs[1:])
        )
        self.counts.append(len(msgs))
        return ok and len(msgs) % 2 == 0 and (req["model"], req["max_tokens"]) == (MODEL, MAX_TOKENS)


def test_multiturn_conversations_carry_their_history(tmp_path):
    """The multiturn workload sends each user's history (system prompt, questions, the server's answers) and a new
    question, TURNS turns per conversation, and reports TTFT by turn and the server's cached tokens."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), MultiTurnHandler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPT + "\n")
    env = {
        **os.environ,
        "MOA_LOADTEST_HOST": f"http://127.0.0.1:{server.server_address[1]}",
        "MOA_LOADTEST_API_KEY": API_KEY,
        "MOA_LOADTEST_MAX_TOKENS": str(MAX_TOKENS),
        "MOA_LOADTEST_PROMPTS": str(prompts),
        "MOA_LOADTEST_MIX": "multiturn",
        "MOA_LOADTEST_TURNS": "3",
        "MOA_LOADTEST_SYSTEM_PROMPT": "be brief",
    }
    env.pop("MOA_LOADTEST_MODEL", None)
    try:
        proc = subprocess.run(
            [find_tool("locust"), "-f", str(ROOT / "loadtest" / "chat.py"), "--headless", "-u", "2", "-r", "2"]
            + ["-t", "3s", "--csv", str(tmp_path / "run"), "--only-summary", "--exit-code-on-error", "1"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            cwd=tmp_path,
        )
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(open(tmp_path / "run_stats.csv"))}
    assert int(rows[("", "Aggregated")]["Failure Count"]) == 0
    assert int(rows[("POST", "/v1/chat/completions (multiturn)")]["Request Count"]) > 6
    assert set(MultiTurnHandler.counts) == {2, 4, 6}  # turns 1-3, then a new conversation
    for name in ("ttft_ms (turn 1)", "ttft_ms (turn 2+)", "cached_tokens"):
        assert int(rows[("METRIC", name)]["Request Count"]) > 0, name


@pytest.mark.parametrize(
    "mix,message",
    [
        ("chat:2,nope:1", "unknown workload 'nope'"),
        ("chat:x", "weight of 'chat' is not a whole number"),
        ("chat:0", "no workload with a positive weight"),
        ("tools:-1,chat", "weight of 'tools' is negative"),
        ("chat ORDER=shuffled", "ORDER: 'shuffled' is neither random nor cycle"),
    ],
)
def test_a_bad_workload_mix_is_a_clear_error(mix, message, tmp_path):
    mix, _, order = mix.partition(" ORDER=")
    proc = subprocess.run(
        [
            find_tool("locust"),
            "-f",
            str(ROOT / "loadtest" / "chat.py"),
            "--headless",
            "-u",
            "1",
            "-t",
            "1s",
            "--only-summary",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "MOA_LOADTEST_MIX": mix, **({"MOA_LOADTEST_ORDER": order} if order else {})},
        cwd=tmp_path,
    )
    expected = f"MOA_LOADTEST_{message}" if order else f"MOA_LOADTEST_MIX: {message}"
    assert proc.returncode != 0 and expected in proc.stderr, proc.stderr[-2000:]


class TwoTenantsHandler(BaseHTTPRequestHandler):
    """Two keys: the flood's requests alternate between a 429 (Retry-After: 1) and a stream, the steady key's always
    stream; any other key is a 401. Records which key each request carried."""

    protocol_version = "HTTP/1.1"
    keys = ("sk-flood", "sk-steady")
    seen: list[str] = []

    def log_message(self, *args):
        pass

    def _json(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        for k, v in {"content-type": "application/json", "content-length": str(len(data)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _key(self) -> str | None:
        key = (self.headers.get("authorization") or "").removeprefix("Bearer ")
        if key in self.keys:
            return key
        self._json(401, {"error": {"message": "bad key", "type": "auth", "param": None, "code": None}})
        return None

    def do_GET(self):
        if self._key():
            self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        key = self._key()
        if key is None:
            return
        self.seen.append(key)
        if key == self.keys[0] and self.seen.count(key) % 2 == 1:
            error = {"message": "busy", "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}
            return self._json(429, {"error": error}, {"retry-after": "1"})
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        try:
            for i in range(3):
                time.sleep(0.01)
                chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": f"w{i}"}}]}
                data = f"data: {json.dumps(chunk)}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(b"data: [DONE]\n\n"), b"data: [DONE]\n\n"))
        except (BrokenPipeError, ConnectionResetError):
            pass


def test_noisy_neighbour_scenario_reports_each_tenants_ttft_and_rejections(tmp_path):
    """loadtest/tenants.py under headless locust: the steady tenant alone, then beside the flood; each tenant's TTFT
    by phase and its 429s (waited out, not failures), in the CSV and the summary JSON."""
    TwoTenantsHandler.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), TwoTenantsHandler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {
        **os.environ,
        "MOA_LOADTEST_FLOOD_KEY": "sk-flood",
        "MOA_LOADTEST_STEADY_KEY": "sk-steady",
        "MOA_LOADTEST_ALONE_S": "2",
        "MOA_LOADTEST_FLOOD_S": "3",
        "MOA_LOADTEST_FLOOD_USERS": "3",
        "MOA_LOADTEST_STEADY_WAIT": "0.1",
        "MOA_LOADTEST_SUMMARY": str(tmp_path / "summary.json"),
    }
    env.pop("MOA_LOADTEST_MODEL", None)
    try:
        proc = subprocess.run(
            [find_tool("locust"), "-f", str(ROOT / "loadtest" / "tenants.py"), "--headless"]
            + ["--host", f"http://127.0.0.1:{server.server_address[1]}", "--csv", str(tmp_path / "run")]
            + ["--only-summary", "--exit-code-on-error", "1"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            cwd=tmp_path,
        )
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    steady, flood = summary["steady"], summary["flood"]
    assert steady["alone"]["count"] > 0 and steady["flood"]["count"] > 0 and steady["rejected"] == 0
    assert flood["flood"]["count"] > 0 and flood["rejected"] > 0
    assert 0 < steady["alone"]["p50"] <= steady["alone"]["p95"] <= steady["alone"]["max"]
    rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(open(tmp_path / "run_stats.csv"))}
    assert int(rows[("", "Aggregated")]["Failure Count"]) == 0
    for name in ("ttft_ms steady (alone)", "ttft_ms steady (flood)", "ttft_ms flood", "rejected flood"):
        assert int(rows[("METRIC", name)]["Request Count"]) > 0, name
    assert ("METRIC", "rejected steady") not in rows
    assert float(rows[("METRIC", "rejected flood")]["Average Response Time"]) == 1000  # its Retry-After, in ms
    assert TwoTenantsHandler.seen.index("sk-flood") > TwoTenantsHandler.seen.index("sk-steady")  # alone, then flood
