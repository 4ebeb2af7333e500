"""`moa-serve bench --gateway-overhead`: the cost of the HTTP gateway over calling the engine directly."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from moa_serve.benchmarks.batch import fmt


@dataclass
class OverheadResult:
    method: str
    tree: str
    adaptive: bool
    requests: int = 0
    max_tokens: int = 0
    engine_ms: list[float] = field(default_factory=list, repr=False)
    http_ms: list[float] = field(default_factory=list, repr=False)
    same_tokens: bool | None = None  # the HTTP completion's token ids equal the direct engine's
    error: str | None = None

    @property
    def engine_p50(self) -> float | None:
        return statistics.median(self.engine_ms) if self.engine_ms else None

    @property
    def http_p50(self) -> float | None:
        return statistics.median(self.http_ms) if self.http_ms else None

    @property
    def overhead_p50(self) -> float | None:
        return None if self.engine_p50 is None or self.http_p50 is None else self.http_p50 - self.engine_p50


def measure_gateway_overhead(
    target, method: str, tree, adaptive: bool, messages: list[dict], max_tokens: int, requests: int, warmup: int = 2
) -> OverheadResult:
    """p50 latency of one short greedy chat request (fixed length: ignore_eos) (a) through Engine.generate
    and (b) through the real gateway over HTTP on 127.0.0.1 (uvicorn in a thread of this process, an
    Engine with the same drafter and tree). Calls alternate a, b, a, b ... so drift hits both.

    Adaptive speculation is off for both engines whatever `adaptive` says: two policies can settle on
    different trees from timing noise, and then the two paths no longer do the same work."""
    import httpx

    from moa_serve.benchmarks.bench import bench_drafter
    from serving.config import EngineConfig
    from serving.engine import Engine
    from serving.gateway.app import create_app
    from serving.gateway.server import ServerThread, embedded_backend
    from sglang_ext.sampling import SamplingParams

    res = OverheadResult(method, tree.label if method != "vanilla" else "-", False, requests, max_tokens)
    try:
        name = "none" if method == "vanilla" else method
        config = EngineConfig(tree=tree, prefix_cache=False)  # (the same request again and again: no hits measured)
        direct = Engine(target, bench_drafter(method, target), config)
        served = Engine(target, bench_drafter(method, target), config)
        prompt = target.encode_chat(messages)
        sp = SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)
        body = {
            "model": "bench",
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        backend, telemetry = embedded_backend(served, "bench", name)
        with ServerThread(create_app(backend, telemetry)) as srv, httpx.Client(base_url=srv.url, timeout=600) as client:
            http_ids = None
            for i in range(warmup + requests):
                t0 = time.perf_counter()
                out = direct.generate([prompt], sp)[0].output_ids
                t1 = time.perf_counter()
                r = client.post("/v1/chat/completions", json=body)
                t2 = time.perf_counter()
                r.raise_for_status()
                http_ids = r.json()["choices"][0].get("token_ids", http_ids)
                if i >= warmup:
                    res.engine_ms.append((t1 - t0) * 1e3)
                    res.http_ms.append((t2 - t1) * 1e3)
            res.same_tokens = None if http_ids is None else http_ids == out
    except Exception as e:  # noqa: BLE001 - reported in the table
        res.error = f"{type(e).__name__}: {e}"
    return res


def overhead_table(rows: list[OverheadResult]) -> str:
    lines = [
        "| method | tree (d,k,n) | adaptive | requests | new tokens | engine direct p50 (ms) | gateway HTTP p50 (ms) "
        "| overhead p50 (ms) | same tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ad = "yes" if r.adaptive else "no"
        if r.error:
            lines.append(f"| {r.method} | {r.tree} | {ad} | failed: {r.error} | | | | | |")
            continue
        same = "-" if r.same_tokens is None else ("yes" if r.same_tokens else "no")
        lines.append(
            f"| {r.method} | {r.tree} | {ad} | {r.requests} | {r.max_tokens} | {fmt(r.engine_p50, '.1f')} "
            f"| {fmt(r.http_p50, '.1f')} | {fmt(r.overhead_p50, '.1f')} | {same} |"
        )
    return "\n".join(lines)


def overhead_json(rows: list[OverheadResult]) -> list[dict]:
    return [
        {
            "method": r.method,
            "tree": r.tree,
            "adaptive": r.adaptive,
            "requests": r.requests,
            "max_tokens": r.max_tokens,
            "engine_p50_ms": r.engine_p50,
            "http_p50_ms": r.http_p50,
            "overhead_p50_ms": r.overhead_p50,
            "engine_ms": r.engine_ms,
            "http_ms": r.http_ms,
            "same_tokens": r.same_tokens,
            "error": r.error,
        }
        for r in rows
    ]
