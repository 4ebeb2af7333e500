"""Live: a real Prometheus (Debian `prometheus`) on 127.0.0.1 scrapes a live `moa-serve serve` every
second, with deploy/prometheus/rules.yaml loaded, after the gateway served real chat requests. Then every
panel query of the Grafana dashboard must return data, and every recording rule must produce series.

Variables: `$namespace`/`$instance`/`$drafter` become `.*` (the dashboard's "All"; a local Prometheus has no
`namespace` label, and `=~".*"` also matches a missing label), `$__rate_interval` becomes RATE_WINDOW.
"""

from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml
from deploytools import RULES
from liveprocs import Prometheus, finite_values, rules_with_interval
from test_deploy_dashboard import substitute, targets

# 1 s scrapes: a 5 min window holds the whole burst of traffic below (sent once, before the queries) however long
# the module's queries take after it on a busy machine, so rate() and histogram_quantile() have non-zero rates to
# work on for every panel, the last ones included (a 30 s window lost the Tenants row's panels in a loaded suite).
RATE_WINDOW = "5m"

# Panels that cannot have data on a healthy gateway, and why. Each is still sent to Prometheus (it must be a
# valid query) and its metric family must be declared on the live /metrics.
EXEMPT = {
    "Drafter fallbacks/s [A]": (
        "moa_drafter_fallbacks_total",
        "a series per `reason` appears only when a drafter raises or proposes an out-of-vocabulary token "
        "(serving/engine.py _fallback); no request parameter makes the ngram drafter fail, and serving/ is "
        "not changed to inject one",
    ),
    "Rejections/s by tenant [A]": (
        "moa_tenant_rejections_total",
        "a series per `reason` appears only when a tenant is refused (a full queue, a max_queued or "
        "tokens_per_minute limit); the burst below stays within the queue and the keys file sets no limits "
        "(tests/serving/test_gateway_tenants.py and test_gateway_errors.py check these series)",
    ),
}

BURST = [  # repetitive prompts: the ngram drafter finds matches, so draft and accepted tokens are > 0
    "Repeat this line three times: the quick brown fox jumps over the lazy dog.",
    "Count from 1 to 20, separated by commas.",
    "Write the alphabet in capital letters, separated by spaces.",
    "Say 'hello world' five times.",
    "List the days of the week, twice.",
    "Repeat after me: one two three, one two three, one two three.",
]


@pytest.fixture(scope="module")
def prometheus(prometheus_binary, live_gateway, tmp_path_factory):  # binary first: skip before the model loads
    tmp = tmp_path_factory.mktemp("prometheus")
    prom = Prometheus(prometheus_binary, tmp, f"127.0.0.1:{live_gateway.port}", rules_with_interval(tmp / "rules.yaml"))
    try:
        yield prom
    finally:
        prom.stop()


@pytest.fixture(scope="module")
def traffic(prometheus, live_gateway):
    """Real chat requests, so that every metric has data; returns once Prometheus has scraped their result."""
    g, prom = live_gateway, prometheus
    prom.wait_until("first scrape of the gateway", lambda: prom.scalar(f'up{{job="{prom.JOB}"}}') == 1, 20)

    # More concurrent requests than --max-running (4): batches of several requests, and a queue.
    drafted = g.sample("moa_draft_tokens_total")  # (the gateway is shared: other tests' traffic may come first)
    with ThreadPoolExecutor(len(BURST)) as pool:
        futures = [pool.submit(g.chat, p, 24, stream=i % 2 == 0) for i, p in enumerate(BURST)]
        results = [f.result(timeout=120) for f in futures]
    for i, (status, body) in enumerate(results):
        assert status == 200, body[:500]
        if i % 2 == 0:
            assert body.rstrip().endswith(b"data: [DONE]"), body[-300:]
    # Statuses other than "ok": a 400 is counted as status="invalid"; a request without the key gets a 401
    # from the auth layer (not a finished completion, so not counted).
    status, body = g.chat("hello", max_tokens=-1)
    assert status == 400 and b"max_tokens" in body, body
    assert g.chat("hello", key=None)[0] == 401
    assert g.chat("hello", key="sk-wrong")[0] == 401

    counts = {s: g.sample("moa_requests_total", status=s) for s in ("ok", "invalid", "error")}
    assert counts["ok"] >= len(BURST) and counts["invalid"] >= 1 and counts["error"] == 0, counts
    assert g.sample("moa_draft_tokens_total") > drafted, (
        "the ngram drafter proposed nothing in the burst: the acceptance panels would be empty"
    )
    batch_steps, single_steps = g.sample("moa_batch_size_count"), g.sample("moa_batch_size_bucket", le="1.0")
    assert single_steps < batch_steps, "no engine step ran more than one request: the burst was not concurrent"

    def scraped() -> bool:  # Prometheus holds the final counts (so it scraped after the last request)
        return all(
            prom.scalar(f'sum(moa_requests_total{{job="{prom.JOB}", status="{s}"}})') == n for s, n in counts.items()
        )

    prom.wait_until("a scrape after the traffic", scraped, 20)
    # and one more scrape (rates need two samples after the traffic): wait for a newer scrape timestamp
    last = prom.scalar(f'timestamp(up{{job="{prom.JOB}"}})')
    prom.wait_until("one more scrape", lambda: prom.scalar(f'timestamp(up{{job="{prom.JOB}"}})') > last, 20)
    return counts


def test_gateway_metrics_pass_promtool(traffic, promtool, live_gateway):
    proc = subprocess.run(
        [promtool, "check", "metrics"], input=live_gateway.metrics_text(), capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_prometheus_scrapes_the_gateway(prometheus, traffic):
    (target,) = prometheus.api("targets")["activeTargets"]
    assert target["health"] == "up" and target["labels"]["job"] == Prometheus.JOB, target
    assert target["scrapeUrl"].startswith("http://127.0.0.1:")
    # Series arrive under the exposed names (no `a:b` → `a_b` rewriting), with the gateway's labels.
    (series,) = prometheus.query('moa_generated_tokens_total{job="moa-serve"}')
    assert series["metric"]["drafter"] == "ngram" and series["metric"]["backend"] == "embedded", series
    assert float(series["value"][1]) > 0


def test_rules_copy_differs_only_in_interval(tmp_path):
    original = yaml.safe_load(RULES.read_text())
    copy = yaml.safe_load(rules_with_interval(tmp_path / "rules.yaml").read_text())
    for group in (*original["groups"], *copy["groups"]):
        group.pop("interval")
    assert copy == original


def test_rules_load_and_recording_rules_produce_series(prometheus, traffic):
    groups = prometheus.api("rules")["groups"]
    loaded = {r["name"]: r for g in groups for r in g["rules"]}
    wanted = [r.get("record") or r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    assert sorted(loaded) == sorted(wanted)
    records = [r for r in wanted if ":" in r]
    assert len(records) == 8, records

    missing: list[str] = []

    def every_record_has_series() -> bool:
        missing[:] = [r for r in records if not prometheus.query(r)]
        return not missing

    try:
        prometheus.wait_until("series from every recording rule", every_record_has_series, 15)
    except pytest.fail.Exception:
        pytest.fail(f"recording rules without series: {missing}")

    for record in records:
        result = prometheus.query(record)
        assert finite_values(result), f"{record}: {result}"
        for series in result:
            assert series["metric"]["job"] == Prometheus.JOB, (record, series)
            if "drafter" in series["metric"]:
                assert series["metric"]["drafter"] == "ngram"
    # Values that follow from the traffic: no errors, drafts proposed, some tokens generated.
    assert prometheus.scalar("moa:request_error_ratio:rate5m") == 0
    assert prometheus.scalar("moa:draft_tokens:rate5m") > 0
    assert prometheus.scalar("moa:generated_tokens:rate5m") > 0
    assert prometheus.scalar("moa:acceptance_length:rate5m") >= 1

    rules = {r["name"]: r for g in prometheus.api("rules")["groups"] for r in g["rules"]}
    unhealthy = {name: (r["health"], r.get("lastError")) for name, r in rules.items() if r["health"] != "ok"}
    assert not unhealthy
    # Every alert has `for:` >= 5m, so none can fire in a run of seconds.
    alerts = prometheus.api("alerts")["alerts"]
    assert not [a for a in alerts if a["state"] == "firing"], alerts
    print("alerts:", {a["labels"]["alertname"]: a["state"] for a in alerts} or "none")


@pytest.mark.parametrize("where, expr", targets(), ids=[w for w, _ in targets()])
def test_panel_query_returns_data(traffic, prometheus, live_gateway, where, expr):
    query = substitute(expr.replace("$__rate_interval", RATE_WINDOW))
    result = prometheus.query(query)
    if where in EXEMPT:
        family, why = EXEMPT[where]
        assert f"# TYPE {family} counter" in live_gateway.metrics_text(), f"{family} is not declared"
        assert not result or finite_values(result), result
        return
    assert result, f"{where}: no data\n{query}"
    assert finite_values(result), f"{where}: only NaN/Inf values {result}\n{query}"


def test_status_panels_count_the_statuses(prometheus, traffic):
    """The error-rate panels have data on a healthy server because the gateway creates every
    moa_requests_total{status} series at start (value 0): no 5xx is needed for "no errors" to show as 0.
    The 400 sent by `traffic` must show up as status="invalid", apart from "ok"."""
    by_status = dict(targets())["Requests/s by status [A]"]
    rates = {
        r["metric"]["status"]: float(r["value"][1])
        for r in prometheus.query(substitute(by_status.replace("$__rate_interval", RATE_WINDOW)))
    }
    assert set(rates) == {"ok", "error", "aborted", "rejected", "invalid"}, rates
    assert rates["ok"] > 0 and rates["invalid"] > 0 and rates["error"] == 0, rates
    error_rate = dict(targets())["Error rate [A]"]  # status="error" over all statuses
    assert finite_values(prometheus.query(substitute(error_rate.replace("$__rate_interval", RATE_WINDOW)))) == [0.0]


def test_exemptions_name_real_panels():
    wheres = {w for w, _ in targets()}
    assert set(EXEMPT) <= wheres
    for where, expr in targets():
        if where in EXEMPT:
            assert re.search(EXEMPT[where][0], expr), where
