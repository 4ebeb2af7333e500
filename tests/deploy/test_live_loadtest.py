"""Live: a bounded headless locust run of loadtest/chat.py (8 users, 20 s, a mix of chat, tool-call,
predicted-output and multi-turn streams, each user going through the mix from its own place, so every workload is
in the users' first requests however slow the machine) against a live `moa-serve serve` (the session's gateway:
SmolLM2 (auto dtype) + ngram on 1 CPU thread, --max-running 4, API key)."""

from __future__ import annotations

import csv
import os
import subprocess

from deploytools import ROOT
from liveprocs import API_KEY

USERS, RUN_TIME, MAX_TOKENS = 8, "20s", 32
MIX = "chat:2,tools:1,prediction:1,generate:1,multiturn:1"
NAMES = (
    "/v1/chat/completions (stream)",
    "/v1/chat/completions (tools)",
    "/v1/chat/completions (prediction)",
    "/generate (stream)",
    "/v1/chat/completions (multiturn)",
)
MT_BENCH = ROOT.parent / "shared" / "data" / "eval" / "mt_bench.jsonl"


def test_locust_against_live_gateway(locust, live_gateway, tmp_path):
    g = live_gateway
    before = {s: g.sample("moa_requests_total", status=s) for s in ("ok", "error", "rejected", "aborted")}
    calls_before = g.sample("moa_tool_calls_total")
    env = {
        **os.environ,
        "MOA_LOADTEST_API_KEY": API_KEY,
        "MOA_LOADTEST_MAX_TOKENS": str(MAX_TOKENS),
        "MOA_LOADTEST_MIX": MIX,
        "MOA_LOADTEST_ORDER": "cycle",
    }
    for var in ("MOA_LOADTEST_MODEL", "MOA_LOADTEST_HOST", "MOA_LOADTEST_PROMPTS", "MOA_LOADTEST_THINK_TIME"):
        env.pop(var, None)  # the model comes from GET /v1/models
    if MT_BENCH.is_file():  # chat prompts of moderate length (the whole eval directory has long documents)
        env["MOA_LOADTEST_PROMPTS"] = str(MT_BENCH)
    # --stop-timeout: at the end of the 20 s the users finish their stream instead of being cut off, so the
    # gateway sees no aborted requests and locust no broken streams.
    proc = subprocess.run(
        [
            locust,
            "-f",
            str(ROOT / "loadtest" / "chat.py"),
            "--host",
            g.url,
            "--headless",
            "-u",
            str(USERS),
            "-r",
            str(USERS),
            "-t",
            RUN_TIME,
            "--stop-timeout",
            "20",
            "--csv",
            str(tmp_path / "run"),
            "--only-summary",
            "--exit-code-on-error",
            "1",
            "--loglevel",
            "WARNING",
        ],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
        cwd=tmp_path,
    )
    out = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, out

    rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(open(tmp_path / "run_stats.csv"))}
    assert int(rows[("", "Aggregated")]["Failure Count"]) == 0, out
    failures = list(csv.DictReader(open(tmp_path / "run_failures.csv")))
    assert not failures, failures
    by_name = {name: int(rows[("POST", name)]["Request Count"]) if ("POST", name) in rows else 0 for name in NAMES}
    requests = sum(by_name.values())
    assert requests >= USERS, out  # every user finished at least one stream
    assert all(by_name.values()), by_name  # 8 users from 6 places of the mix: each workload at least once
    # a tools reply without a call fails (unless cut at max_tokens: the model can ramble inside a string), and
    # the gateway counted the calls
    assert g.sample("moa_tool_calls_total") - calls_before >= by_name[NAMES[1]] / 2

    metric = {name: rows[("METRIC", name)] for name in ("ttft_ms", "itl_ms", "e2e_ms", "output_tokens")}
    assert int(metric["ttft_ms"]["Request Count"]) == int(metric["e2e_ms"]["Request Count"]) == requests
    assert int(metric["output_tokens"]["Request Count"]) == requests
    assert int(metric["itl_ms"]["Request Count"]) > 0
    assert 0 < float(metric["output_tokens"]["Average Response Time"]) <= max(MAX_TOKENS, 128)  # tools: 128 at least
    assert 0 < float(metric["ttft_ms"]["Median Response Time"]) <= float(metric["e2e_ms"]["Median Response Time"])
    # the chat template's system prompt is every chat's: later requests find it in the prefix cache
    assert float(rows[("METRIC", "cached_tokens")]["Max Response Time"]) > 0

    # The gateway counted the same requests, all ok. Locust writes run_stats.csv before the streams that end
    # in the --stop-timeout phase are counted (its printed summary has them), so the CSV can miss up to one
    # request per user.
    after = {s: g.sample("moa_requests_total", status=s) for s in before}
    delta = {s: after[s] - before[s] for s in before}
    assert requests <= delta.pop("ok") <= requests + USERS, (after, before, requests)
    assert delta == {"error": 0, "rejected": 0, "aborted": 0}, delta
    print(
        f"locust: {requests} streams, ttft median {metric['ttft_ms']['Median Response Time']} ms, "
        f"itl median {metric['itl_ms']['Median Response Time']} ms, e2e median "
        f"{metric['e2e_ms']['Median Response Time']} ms"
    )
