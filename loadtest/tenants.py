"""Noisy neighbour: two tenants (two API keys) against one OpenAI-compatible endpoint, one flooding, one steady.

    MOA_LOADTEST_FLOOD_KEY=sk-a MOA_LOADTEST_STEADY_KEY=sk-b locust -f loadtest/tenants.py \
        --host http://127.0.0.1:8000 --headless --csv results/tenants/run --only-summary

Two phases, in one run (the load shape below; `-u`/`-t` are not used):
  alone   MOA_LOADTEST_ALONE_S seconds (default 30): the steady tenant only
  flood   MOA_LOADTEST_FLOOD_S seconds (default 60): the steady tenant and MOA_LOADTEST_FLOOD_USERS flood users
          (default 12), each keeping one streamed request in flight (closed loop; after a 429 it waits the
          response's Retry-After, as the openai client does, and sends again)
The steady user sends one streamed request at a time, MOA_LOADTEST_STEADY_WAIT seconds apart (default 0.5).

Each tenant's streams report, as request_type "METRIC" rows (response_time column = the value, ms):
  ttft_ms steady (alone), ttft_ms steady (flood), ttft_ms flood     time to the first content token
  rejected steady, rejected flood                                   a 429 (value: its Retry-After in ms)
and a request name per tenant ("/v1/chat/completions [steady]", "... [flood]"); a 429 is not a failure of the
run (it is what the server should do with a flood), any other error is. At the end the exact percentiles are
printed and, with MOA_LOADTEST_SUMMARY=path, written as JSON: {"steady": {"alone": {...}, "flood": {...},
"rejected": n}, "flood": {...}} with each TTFT's count, p50, p95 and max in seconds.

Environment (also loadtest/chat.py's MOA_LOADTEST_MODEL, MOA_LOADTEST_PROMPTS):
  MOA_LOADTEST_FLOOD_KEY, MOA_LOADTEST_STEADY_KEY   the two tenants' API keys (required)
  MOA_LOADTEST_FLOOD_MAX_TOKENS    default 128: the flood's long answers hold the running slots
  MOA_LOADTEST_STEADY_MAX_TOKENS   default 32
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time

from chat import PROMPTS, fire_metric, sse_lines
from locust import HttpUser, LoadTestShape, constant, events, task

FLOOD_KEY = os.environ.get("MOA_LOADTEST_FLOOD_KEY", "")
STEADY_KEY = os.environ.get("MOA_LOADTEST_STEADY_KEY", "")
ALONE_S = float(os.environ.get("MOA_LOADTEST_ALONE_S", "30"))
FLOOD_S = float(os.environ.get("MOA_LOADTEST_FLOOD_S", "60"))
FLOOD_USERS = int(os.environ.get("MOA_LOADTEST_FLOOD_USERS", "12"))
STEADY_WAIT = float(os.environ.get("MOA_LOADTEST_STEADY_WAIT", "0.5"))
FLOOD_MAX_TOKENS = int(os.environ.get("MOA_LOADTEST_FLOOD_MAX_TOKENS", "128"))
STEADY_MAX_TOKENS = int(os.environ.get("MOA_LOADTEST_STEADY_MAX_TOKENS", "32"))
STEADY_PROMPTS = ["Name three colors.", "What is 2 + 2?", "Say hello in French.", "Name a planet."]

# what each tenant saw: TTFTs (s) by phase, and how many 429s
SEEN: dict = {"steady": {"alone": [], "flood": [], "rejected": 0}, "flood": {"flood": [], "rejected": 0}}
PHASE = {"now": "alone"}


class TenantUser(HttpUser):
    abstract = True
    tenant, key, max_tokens = "", "", 0

    def on_start(self) -> None:
        if not self.key:
            raise RuntimeError("set MOA_LOADTEST_FLOOD_KEY and MOA_LOADTEST_STEADY_KEY (the two tenants' API keys)")
        self.headers = {"Authorization": f"Bearer {self.key}"}
        self.model = os.environ.get("MOA_LOADTEST_MODEL") or self._first_model()

    def _first_model(self) -> str:
        with self.client.get("/v1/models", headers=self.headers, catch_response=True) as resp:
            if resp.status_code == 200 and resp.json().get("data"):
                return resp.json()["data"][0]["id"]
            resp.failure(f"GET /v1/models: HTTP {resp.status_code}")
            return "default"

    def stream(self, content: str) -> float | None:
        """One streamed chat; its TTFT in s, or None after a 429 (waited out) or a failure."""
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": True,
        }
        phase, start = PHASE["now"], time.perf_counter()
        name = f"/v1/chat/completions [{self.tenant}]"
        with self.client.post(
            "/v1/chat/completions", json=body, headers=self.headers, stream=True, catch_response=True, name=name
        ) as resp:
            if resp.status_code == 429:
                retry = float(resp.headers.get("retry-after") or 1)
                resp.success()  # refusing a flood is the server's job, not a failure of this run
                SEEN[self.tenant]["rejected"] += 1
                fire_metric(f"rejected {self.tenant}", retry * 1000)
                time.sleep(retry)
                return None
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return None
            ttft = None
            for raw in sse_lines(resp.raw):
                line = raw.decode("utf-8").rstrip("\r")
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    resp.failure(f"error event: {chunk['error']}")
                    return None
                if ttft is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                    ttft = time.perf_counter() - start
            if ttft is None:
                resp.failure("stream ended without content")
                return None
        label = f"{self.tenant} ({phase})" if self.tenant == "steady" else self.tenant
        fire_metric(f"ttft_ms {label}", ttft * 1000)
        SEEN[self.tenant][phase if self.tenant == "steady" else "flood"].append(ttft)
        return ttft


class SteadyUser(TenantUser):
    """The well-behaved tenant: one short request at a time."""

    fixed_count = 1
    tenant, key, max_tokens = "steady", STEADY_KEY, STEADY_MAX_TOKENS
    wait_time = constant(STEADY_WAIT)

    @task
    def ask(self) -> None:
        self.stream(random.choice(STEADY_PROMPTS))


class FloodUser(TenantUser):
    """The noisy tenant: FLOOD_USERS of these, each a request in flight at all times."""

    tenant, key, max_tokens = "flood", FLOOD_KEY, FLOOD_MAX_TOKENS
    wait_time = constant(0)

    @task
    def ask(self) -> None:
        self.stream(random.choice(PROMPTS))


class AloneThenFlood(LoadTestShape):
    """The steady tenant alone, then with the flood; the flood's users start together."""

    def tick(self):
        t = self.get_run_time()
        if t < ALONE_S:
            return 1, 1, [SteadyUser]
        if t < ALONE_S + FLOOD_S:
            PHASE["now"] = "flood"
            return 1 + FLOOD_USERS, 100, [SteadyUser, FloodUser]
        return None


def _summary(ttfts: list[float]) -> dict:
    if not ttfts:
        return {"count": 0}
    q = statistics.quantiles(ttfts, n=20, method="inclusive") if len(ttfts) > 1 else [ttfts[0]] * 19
    return {"count": len(ttfts), "p50": statistics.median(ttfts), "p95": q[18], "max": max(ttfts)}


@events.test_stop.add_listener
def _report(**_kw) -> None:
    steady, flood = SEEN["steady"], SEEN["flood"]
    steady_out = {"alone": _summary(steady["alone"]), "flood": _summary(steady["flood"])}
    out = {
        "steady": {**steady_out, "rejected": steady["rejected"]},
        "flood": {"flood": _summary(flood["flood"]), "rejected": flood["rejected"]},
    }
    path = os.environ.get("MOA_LOADTEST_SUMMARY")
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=2)
    print("noisy neighbour:", json.dumps(out))
