"""`moa-serve serve` as a real process: env-configured API keys, then SIGTERM with requests in flight.

The in-flight requests (streaming and not) must complete in full, new requests must get 503 while
draining, /ready must turn 503 (liveness stays 200), and the process must exit 0 once drained.
"""

import concurrent.futures as cf
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
KEY = "sigterm-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "server exited during start-up"
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("server did not become ready")


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_sigterm_drains_in_flight_requests(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"# test keys\n{KEY}\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MOA_SERVE_API_KEYS_FILE": str(keys), "MOA_SERVE_BACKEND": "embedded"}
    env.pop("MOA_SERVE_API_KEYS", None)
    log = open(tmp_path / "server.log", "w")
    cmd = [
        sys.executable,
        "-m",
        "moa_serve.entrypoints.cli",
        "serve",
        "--port",
        str(port),
        "--dtype",
        "float32",  # default drafter: auto
        "--kv-slots",
        "2048",
        "--threads",
        "1",
        "--drain-timeout",
        "120",
        "--no-access-log",
    ]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_up(url, proc)
        assert (
            httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}).status_code
            == 401
        )
        assert httpx.get(url + "/v1/models", headers=AUTH).json()["data"][0]["id"] == "smollm2"

        body = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": "Write a poem about the sea."}],
            "max_tokens": 48,
            "temperature": 0,
            "ignore_eos": True,
        }

        def plain(_):
            r = httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=300)
            return r.status_code, r.json()

        def streamed():
            with httpx.stream(
                "POST",
                url + "/v1/chat/completions",
                json={**body, "stream": True, "stream_options": {"include_usage": True}},
                headers=AUTH,
                timeout=300,
            ) as r:
                events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
            return r.status_code, events

        with cf.ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(plain, 0), pool.submit(plain, 1), pool.submit(streamed)]
            deadline = time.monotonic() + 60
            while metric(url, "moa_running_requests") < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert metric(url, "moa_running_requests") == 3
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 60  # wait for the drain to start, not for a fixed time
            while httpx.get(url + "/ready").status_code != 503 and time.monotonic() < deadline:
                time.sleep(0.05)
            late = httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=30)
            assert (
                late.status_code == 503
                and late.json()["error"]["code"] == "service_unavailable"
                and late.headers["retry-after"]
            )
            assert httpx.get(url + "/ready").status_code == 503
            assert httpx.get(url + "/health").status_code == 200
            results = [f.result(timeout=300) for f in futures]
        for status, out in results[:2]:
            assert (
                status == 200
                and out["choices"][0]["finish_reason"] == "length"
                and out["usage"]["completion_tokens"] == 48
            )
        status, events = results[2]
        assert status == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 48
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    text = (tmp_path / "server.log").read_text()
    assert "drained; shutting down" in text, text[-2000:]
    assert "drafter 'suffix'" in text  # --drafter auto: SmolLM2 has a shipped suffix corpus
