"""Live processes for the deploy tests: a real `moa-serve serve` and a real Prometheus, both on 127.0.0.1.

Every wait has a deadline, every process is stopped by its own pid (SIGTERM, then SIGKILL), and a failure
message carries the tail of the process's log.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from deploytools import RULES

LOOPBACK = "127.0.0.1"
API_KEY = "sk-live-deploy-test"
# The gateway under test: the brief's small CPU configuration. --max-running 4 so that the 8 locust users
# (and the dashboard test's concurrent burst) queue, which gives the queue and batch-size panels real values.
# A fixed tree (--no-adaptive): the dashboard's acceptance panels need drafts in test_live_dashboard's burst, and under
# the adaptive policy whether a step drafts follows the machine's measured speed (after the loadtest's traffic on this
# shared gateway the policy could keep drafting off through the whole burst: no rate of drafts, no acceptance series)
GATEWAY_ARGS = (
    *("--model", "smollm2", "--dtype", "auto", "--drafter", "ngram", "--no-adaptive"),
    *("--threads", "1", "--max-running", "4"),
)
GATEWAY_START_TIMEOUT = float(os.environ.get("MOA_LIVE_START_TIMEOUT", "150"))  # first run converts the GGUF (~30 s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def http(
    method: str, url: str, body: dict | None = None, headers: dict | None = None, timeout: float = 30
) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url, data=data, method=method, headers={"content-type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class LiveProcess:
    """A subprocess with its output in a log file; stop() is idempotent and ends only this pid."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict | None = None, cwd: Path | None = None):
        self.name, self.log = name, log
        self._log_file = open(log, "wb")
        self.proc = subprocess.Popen(
            argv, stdout=self._log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=cwd
        )

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_ready(self, what: str, check, timeout: float, interval: float = 0.25) -> None:
        """wait_until() for the start-up; the process is stopped when it never gets ready."""
        try:
            self.wait_until(what, check, timeout, interval)
        except BaseException:
            self.stop()
            raise

    def wait_until(self, what: str, check, timeout: float, interval: float = 0.25):
        """Poll check() (truthy = done) until the deadline; fail early if the process died."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"{self.name} exited with {self.proc.returncode} while waiting for {what}:\n{self.tail()}")
            try:
                result = check()
            except (OSError, ValueError):
                result = None
            if result:
                return result
            if time.monotonic() > deadline:
                pytest.fail(f"{self.name}: no {what} after {timeout:.0f} s:\n{self.tail()}")
            time.sleep(interval)

    def stop(self, grace: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log_file.close()


class Gateway(LiveProcess):
    def __init__(self, tmp: Path):
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        keys = tmp / "api-keys.txt"
        keys.write_text(API_KEY + "\n")
        env = {**os.environ, "MOA_SERVE_API_KEYS_FILE": str(keys), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        for var in ("MOA_SERVE_BACKEND", "MOA_SERVE_UPSTREAM", "MOA_SERVE_API_KEYS"):
            env.pop(var, None)
        script = Path(sys.executable).parent / "moa-serve"  # the console script; the module when not installed
        cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "moa_serve.entrypoints.cli"]
        argv = [
            *cmd,
            "serve",
            "--host",
            LOOPBACK,
            "--port",
            str(self.port),
            *GATEWAY_ARGS,
            "--drain-timeout",
            "5",
            "--no-access-log",
            "--log-level",
            "warning",
        ]
        super().__init__("moa-serve serve", argv, tmp / "gateway.log", env=env, cwd=Path(__file__).resolve().parents[2])
        self.wait_ready(
            "/ready", lambda: http("GET", self.url + "/ready", timeout=2)[0] == 200, GATEWAY_START_TIMEOUT, 0.5
        )

    def chat(
        self, content: str, max_tokens: int = 16, stream: bool = False, key: str | None = API_KEY, **extra
    ) -> tuple[int, bytes]:
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0, **extra}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return http("POST", self.url + "/v1/chat/completions", body, headers, timeout=60)

    def metrics_text(self) -> str:
        status, body = http("GET", self.url + "/metrics", timeout=10)
        assert status == 200, body[:500]
        return body.decode()

    def sample(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`, from the gateway's own /metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        total = 0.0
        for fam in text_string_to_metric_families(self.metrics_text()):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total


# The rules as committed, except each group's evaluation interval, which becomes 1 s so that a test of a
# few seconds sees the recorded series (a 30 s group is first evaluated at a hash-determined offset of up
# to 30 s). Expressions, names, labels and order are unchanged; test_rules_copy_differs_only_in_interval
# checks that.
def rules_with_interval(dest: Path, interval: str = "1s") -> Path:
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        group["interval"] = interval
    dest.write_text(yaml.safe_dump(doc, sort_keys=False))
    return dest


class Prometheus(LiveProcess):
    JOB = "moa-serve"

    def __init__(self, binary: str, tmp: Path, target: str, rules: Path):
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        config = tmp / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(rules)],
                    "scrape_configs": [
                        {"job_name": self.JOB, "metrics_path": "/metrics", "static_configs": [{"targets": [target]}]}
                    ],
                }
            )
        )
        argv = [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address={LOOPBACK}:{self.port}",
            "--storage.tsdb.retention.time=1h",
            "--log.level=warn",
        ]
        super().__init__("prometheus", argv, tmp / "prometheus.log", cwd=tmp)
        self.wait_ready("/-/ready", lambda: http("GET", self.url + "/-/ready", timeout=2)[0] == 200, 30)

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
        status, body = http("GET", url, timeout=10)
        doc = json.loads(body)
        assert status == 200 and doc["status"] == "success", f"{path} {params}: HTTP {status} {body[:500]!r}"
        return doc["data"]

    def query(self, expr: str) -> list[dict]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return data["result"]

    def scalar(self, expr: str) -> float | None:
        """The single value of a query that returns one series, else None."""
        result = self.query(expr)
        return float(result[0]["value"][1]) if len(result) == 1 else None


def finite_values(result: list[dict]) -> list[float]:
    return [v for v in (float(r["value"][1]) for r in result) if math.isfinite(v)]
