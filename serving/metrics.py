"""Prometheus metrics. Names are `moa_*` (no colons: promtool rejects them); labels drafter/backend, and `tenant`
on the moa_tenant_* families: a tenant's name from the API-keys file (serving/tenancy.py), never a key, so
their series are bounded by the file ("default" without keys).

Acceptance rate   = rate(moa_accepted_tokens_total) / rate(moa_draft_tokens_total)
Acceptance length = (rate(moa_accepted_tokens_total) + rate(moa_verify_steps_total)) / rate(moa_verify_steps_total)
                    (also moa_accept_length histogram: accepted + 1 per verify step)
Prefix cache hit rate = rate(moa_prefix_cache_hit_tokens_total) / rate(moa_prefix_cache_query_tokens_total)
"""

from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_LABELS = ("drafter", "backend")


@functools.cache  # (the adaptive policy asks every step)
def batch_bucket(bs: int) -> str:
    """Smallest bucket >= bs (as a label value)."""
    for b in BATCH_BUCKETS:
        if bs <= b:
            return str(b)
    return str(BATCH_BUCKETS[-1])


class Metrics:
    """The gateway's metric families, registered in `registry` (a fresh one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self._add_counters(r)
        self._add_histograms(r)
        self._add_gauges(r)
        self._add_tenant_metrics(r)

    def _add_counters(self, r: CollectorRegistry) -> None:
        """Requests, tokens, verify steps, fallbacks and faults."""
        self.requests = Counter(
            "moa_requests",
            "Finished requests by status (ok, error, aborted, rejected, invalid)",
            (*_LABELS, "status"),
            registry=r,
        )
        self.prompt_tokens = Counter("moa_prompt_tokens", "Prompt tokens processed", _LABELS, registry=r)
        self.generated_tokens = Counter("moa_generated_tokens", "Tokens generated", _LABELS, registry=r)
        self.draft_tokens = Counter(
            "moa_draft_tokens",
            "Draft tokens proposed for verification (tree nodes without the root)",
            _LABELS,
            registry=r,
        )
        self.accepted_tokens = Counter(
            "moa_accepted_tokens", "Draft tokens accepted by verification (bonus tokens excluded)", _LABELS, registry=r
        )
        self.verify_steps = Counter(
            "moa_verify_steps", "Verify steps (one per request per decode step)", _LABELS, registry=r
        )
        self.drafter_fallbacks = Counter(
            "moa_drafter_fallbacks", "Requests that fell back to vanilla decoding", (*_LABELS, "reason"), registry=r
        )
        self.request_faults = Counter(
            "moa_request_faults",
            "Requests ended by an internal fault, by the stage that failed (reason); the other requests carried on, "
            "except for reason step: a fault no single request could be blamed for fails that engine step's requests",
            (*_LABELS, "reason"),
            registry=r,
        )
        self.grammar_work = Counter(
            "moa_grammar_work",
            "Requests' grammar work (structured output, tool schemas) by result: cached, or a compile worker's "
            "job that compiled, refused (the client's grammar: invalid, over a limit, matches no text), timeout "
            "(past the compile budget: the worker was ended), cancelled (the client left: the worker was ended), "
            "busy (too many waiting) or failed (a server fault)",
            (*_LABELS, "result"),
            registry=r,
        )
        self.tool_calls = Counter(
            "moa_tool_calls", "Tool calls returned to clients (parsed from chat replies)", _LABELS, registry=r
        )
        self.prefix_cache_query_tokens = Counter(
            "moa_prefix_cache_query_tokens",
            "Prompt tokens looked up in the prefix cache (every prompt token of a request, when the cache is on; "
            "counted with the request's first token)",
            _LABELS,
            registry=r,
        )
        self.prefix_cache_hit_tokens = Counter(
            "moa_prefix_cache_hit_tokens",
            "Prompt tokens found in the prefix cache when the request's prefill started: their K/V reused, not "
            "prefilled",
            _LABELS,
            registry=r,
        )
        self.prediction_tokens = Counter(
            "moa_prediction_tokens",
            "Predicted-output tokens by whether they appeared in the output (accepted, rejected)",
            (*_LABELS, "result"),
            registry=r,
        )

    def _add_histograms(self, r: CollectorRegistry) -> None:
        """Per verify step (accept length, draft tokens, batch size) and per request (latencies)."""
        self.accept_length = Histogram(
            "moa_accept_length",
            "Accepted draft tokens + 1 per verify step",
            _LABELS,
            buckets=tuple(range(1, 17)),
            registry=r,
        )
        self.draft_tokens_per_step = Histogram(
            "moa_draft_tokens_per_step",
            "Draft tokens per verify step",
            _LABELS,
            buckets=(0, 1, 2, 4, 8, 16, 32, 48, 64),
            registry=r,
        )
        self.batch_size = Histogram(
            "moa_batch_size", "Running requests per engine step", _LABELS, buckets=BATCH_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "moa_time_to_first_token_seconds", "Time to first token", _LABELS, buckets=_LAT, registry=r
        )
        self.itl = Histogram(
            "moa_inter_token_latency_seconds", "Time between streamed tokens", _LABELS, buckets=_ITL, registry=r
        )
        self.e2e = Histogram(
            "moa_request_latency_seconds", "End-to-end request latency", _LABELS, buckets=_LAT, registry=r
        )

    def _add_gauges(self, r: CollectorRegistry) -> None:
        """Occupancy (running, queued), the KV cache and recent throughput."""
        self.running = Gauge("moa_running_requests", "Requests being decoded", _LABELS, registry=r)
        self.queued = Gauge("moa_queued_requests", "Requests waiting for admission", _LABELS, registry=r)
        self.kv_used = Gauge(
            "moa_kv_cache_used_tokens",
            "Target KV cache slots holding tokens running requests use, cached prefixes they hit included; cached "
            "tokens no request uses count as free (embedded engine)",
            _LABELS,
            registry=r,
        )
        self.kv_reserved = Gauge(
            "moa_kv_cache_reserved_tokens",
            "Target KV cache slots reserved by admitted requests: prompt + max_tokens + one draft tree each, less the "
            "prompt tokens taken from the prefix cache, plus the cached prefixes they hit (embedded engine)",
            _LABELS,
            registry=r,
        )
        self.kv_capacity = Gauge(
            "moa_kv_cache_capacity_tokens",
            "Target KV cache slots the engine can hand out (embedded engine)",
            _LABELS,
            registry=r,
        )
        self.prefix_cache_tokens = Gauge(
            "moa_prefix_cache_tokens",
            "Tokens in the prefix cache (embedded engine); those no running request uses are evicted when the KV "
            "cache needs room",
            _LABELS,
            registry=r,
        )
        self.tokens_per_s = Gauge(
            "moa_throughput_tokens_per_second",
            "Recent generated tokens/s by batch-size bucket",
            (*_LABELS, "batch_bucket"),
            registry=r,
        )

    def _add_tenant_metrics(self, r: CollectorRegistry) -> None:
        """Per tenant: requests, tokens, refusals and time in the admission queue."""
        by_tenant = (*_LABELS, "tenant")
        self.tenant_requests = Counter(
            "moa_tenant_requests",
            "Finished requests per tenant by status (ok, error, aborted, rejected, invalid), as moa_requests_total",
            (*by_tenant, "status"),
            registry=r,
        )
        self.tenant_prompt_tokens = Counter(
            "moa_tenant_prompt_tokens",
            "Prompt tokens of a tenant's admitted requests, counted when each ends",
            by_tenant,
            registry=r,
        )
        self.tenant_generated_tokens = Counter(
            "moa_tenant_generated_tokens",
            "Tokens generated for a tenant's requests, counted when each ends",
            by_tenant,
            registry=r,
        )
        self.tenant_rejections = Counter(
            "moa_tenant_rejections",
            "A tenant's requests refused with a 429 by reason: queue (its share of a full queue or its max_queued; "
            "also a queued request pushed out by a tenant with a shorter queue) or tokens_per_minute; too_large: "
            "one request over its tokens_per_minute (a 400)",
            (*by_tenant, "reason"),
            registry=r,
        )
        self.tenant_queue_time = Histogram(
            "moa_tenant_queue_time_seconds",
            "Time a tenant's admitted requests waited in the admission queue",
            by_tenant,
            buckets=_LAT,
            registry=r,
        )
