"""The metrics of serving/metrics.py bound to one (drafter, backend) label pair, plus the recent-throughput window."""

from __future__ import annotations

import threading
import time
from collections import deque

from ..metrics import BATCH_BUCKETS, Metrics, batch_bucket


def _total(counter) -> float:
    """A counter child's value, read as a scrape reads it (its `_total` sample)."""
    return next(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


REQUEST_STATUSES = ("ok", "error", "aborted", "rejected", "invalid")
THROUGHPUT_WINDOW_S = 10.0


class Telemetry:
    """Thread-safe (prometheus_client children are); used by the engine thread and the event loop."""

    def spec_counts(self) -> tuple[float, float]:
        """(verify steps, accepted draft tokens) counted since start, as the counters export them."""
        return _total(self.verify_steps), _total(self.accepted_tokens)

    def __init__(self, metrics: Metrics, drafter: str, backend: str):
        self.metrics = metrics
        lab = {"drafter": drafter, "backend": backend}
        self._lab = lab
        m = metrics
        self.prompt_tokens = m.prompt_tokens.labels(**lab)
        self.generated_tokens = m.generated_tokens.labels(**lab)
        self.draft_tokens = m.draft_tokens.labels(**lab)
        self.accepted_tokens = m.accepted_tokens.labels(**lab)
        self.verify_steps = m.verify_steps.labels(**lab)
        self.accept_length = m.accept_length.labels(**lab)
        self.draft_per_step = m.draft_tokens_per_step.labels(**lab)
        self.batch_size = m.batch_size.labels(**lab)
        self.ttft = m.ttft.labels(**lab)
        self.itl = m.itl.labels(**lab)
        self.e2e = m.e2e.labels(**lab)
        self.running = m.running.labels(**lab)
        self.queued = m.queued.labels(**lab)
        self._requests = {s: m.requests.labels(**lab, status=s) for s in REQUEST_STATUSES}
        self._tool_calls = m.tool_calls.labels(**lab)
        self._prefix_query = m.prefix_cache_query_tokens.labels(**lab)
        self._prefix_hit = m.prefix_cache_hit_tokens.labels(**lab)
        self._prediction = {r: m.prediction_tokens.labels(**lab, result=r) for r in ("accepted", "rejected")}
        self._tput = {str(b): m.tokens_per_s.labels(**lab, batch_bucket=str(b)) for b in BATCH_BUCKETS}
        self._window: dict[str, deque] = {b: deque() for b in self._tput}  # bucket -> (t_end, tokens, seconds)
        self._lock = threading.Lock()
        self.tenants = TenantTelemetry(metrics, lab)

    def request(self, status: str, tenant: str | None = None) -> None:
        self._requests[status].inc()
        if tenant is not None:
            self.tenants.request(tenant, status)

    def fallback(self, reason: str) -> None:
        self.metrics.drafter_fallbacks.labels(**self._lab, reason=reason).inc()

    def fault(self, reason: str) -> None:
        """A request ended by an internal fault in stage `reason` (the others carried on, unless reason is "step")."""
        self.metrics.request_faults.labels(**self._lab, reason=reason).inc()

    def grammar_work(self, result: str) -> None:
        self.metrics.grammar_work.labels(**self._lab, result=result).inc()

    def tool_calls(self, n: int) -> None:
        self._tool_calls.inc(n)

    def prefix_cache(self, prompt_tokens: int, hit_tokens: int) -> None:
        """One request's prompt looked up in the prefix cache: how many of its tokens were found there."""
        self._prefix_query.inc(prompt_tokens)
        self._prefix_hit.inc(hit_tokens)

    def prediction(self, accepted: int, rejected: int) -> None:
        self._prediction["accepted"].inc(accepted)
        self._prediction["rejected"].inc(rejected)

    def verify_step(self, drafted: int, accepted: int) -> None:
        """One verify step of one request."""
        self.verify_steps.inc()
        self.draft_tokens.inc(drafted)
        self.accepted_tokens.inc(accepted)
        self.accept_length.observe(accepted + 1)
        self.draft_per_step.observe(drafted)

    def spec_totals(
        self, verify_steps: int, drafted: int, accepted: int, accepted_histogram: list[int] | None = None
    ) -> None:
        """A finished request's totals, when per-step data is not available (upstream backend).

        accepted_histogram[i] = verify steps that accepted i draft tokens (SGLang's spec_correct_drafts_histogram).
        """
        if verify_steps <= 0:
            return
        self.verify_steps.inc(verify_steps)
        self.draft_tokens.inc(drafted)
        self.accepted_tokens.inc(accepted)
        if accepted_histogram and sum(accepted_histogram) == verify_steps:
            for i, count in enumerate(accepted_histogram):
                for _ in range(count):
                    self.accept_length.observe(i + 1)
        per_step = drafted / verify_steps
        for _ in range(verify_steps):
            self.draft_per_step.observe(per_step)

    def tokens_out(self, first: bool, gap_s: float, tokens: int) -> None:
        """Timing of one delivery of `tokens` tokens, `gap_s` after the previous one (or after arrival)."""
        if tokens <= 0:
            return
        if first:
            self.ttft.observe(gap_s)
            tokens -= 1
            gap_s = 0.0
        for _ in range(tokens):  # tokens verified together arrive together: spread the gap over them
            self.itl.observe(gap_s / tokens)

    def throughput(self, batch: int, tokens: int, seconds: float) -> None:
        """Tokens produced by one batch step of `batch` requests that took `seconds`."""
        if batch <= 0 or seconds <= 0:
            return
        b = batch_bucket(batch)
        now = time.monotonic()
        with self._lock:
            w = self._window[b]
            w.append((now, tokens, seconds))
            while w and w[0][0] < now - THROUGHPUT_WINDOW_S:
                w.popleft()
            tok, sec = sum(x[1] for x in w), sum(x[2] for x in w)
        self._tput[b].set(tok / sec if sec > 0 else 0.0)

    def occupancy(self, running: int, queued: int) -> None:
        self.running.set(running)
        self.queued.set(queued)

    def kv_cache(self, usage) -> None:
        """usage: a KVCacheUsage, or None (an upstream backend): then no series, rather than a capacity of 0."""
        if usage is not None:
            m = self.metrics
            for gauge, value in (
                (m.kv_used, usage.used),
                (m.kv_reserved, usage.reserved),
                (m.kv_capacity, usage.capacity),
                (m.prefix_cache_tokens, usage.cached),
            ):
                gauge.labels(**self._lab).set(value)


class TenantTelemetry:
    """The moa_tenant_* metrics, labelled by tenant name (the admission queue's observer: serving/tenancy.py)."""

    def __init__(self, metrics: Metrics, lab: dict):
        self.metrics, self._lab = metrics, lab

    def declare(self, tenants: list[str]) -> None:
        """Every known tenant's series at 0 before its first request (as moa_requests_total's statuses): a
        series born with its first burst already counted shows Prometheus no increase, so rate() and the
        dashboard's per-tenant panels would stay empty for it."""
        m = self.metrics
        for t in tenants:
            m.tenant_queue_time.labels(**self._lab, tenant=t)
            m.tenant_prompt_tokens.labels(**self._lab, tenant=t)
            m.tenant_generated_tokens.labels(**self._lab, tenant=t)
            for status in REQUEST_STATUSES:
                m.tenant_requests.labels(**self._lab, tenant=t, status=status)

    def request(self, tenant: str, status: str) -> None:
        self.metrics.tenant_requests.labels(**self._lab, tenant=tenant, status=status).inc()

    def admitted(self, tenant: str, waited_s: float) -> None:
        self.metrics.tenant_queue_time.labels(**self._lab, tenant=tenant).observe(waited_s)

    def refused(self, tenant: str, reason: str) -> None:
        self.metrics.tenant_rejections.labels(**self._lab, tenant=tenant, reason=reason).inc()

    def finished(self, tenant: str, prompt_tokens: int, completion_tokens: int) -> None:
        m = self.metrics
        m.tenant_prompt_tokens.labels(**self._lab, tenant=tenant).inc(prompt_tokens)
        m.tenant_generated_tokens.labels(**self._lab, tenant=tenant).inc(completion_tokens)
