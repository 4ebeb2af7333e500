"""Fixtures for the deploy checks: the real helm / promtool / kubernetes-validate binaries, and a live gateway.

Each fixture skips (with the reason) when its tool is missing; `scripts/install-deploy-tools.sh`
installs all of them (`make check-deploy` runs it first).
"""

from __future__ import annotations

import sys

import pytest
from deploytools import ROOT, Helm, find_tool


@pytest.fixture(scope="session")
def helm(tmp_path_factory) -> Helm:
    return Helm(find_tool("helm"), tmp_path_factory.mktemp("helm-home"))


@pytest.fixture(scope="session")
def promtool() -> str:
    return find_tool("promtool")


@pytest.fixture(scope="session")
def metric_names() -> set[str]:
    """Every series name the gateway can expose, from serving/metrics.py (not a copied list)."""
    try:
        from serving.metrics import Metrics
    except ModuleNotFoundError:  # repo not installed into the venv: import from the checkout
        sys.path.insert(0, str(ROOT))
        from serving.metrics import Metrics
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    return {fam.name + s for fam in Metrics().registry.collect() for s in suffixes[fam.type]}


@pytest.fixture(scope="session")
def promql():
    return pytest.importorskip(
        "promql_parser", reason="promql-parser not installed (run scripts/install-deploy-tools.sh)"
    )


@pytest.fixture(scope="session")
def selector_names(promql):
    """expr -> the metric names of its selectors (every selector must name its metric)."""

    def names(expr: str) -> set[str]:
        found: set[str] = set()

        def visit(node):
            if isinstance(node, promql.VectorSelector):
                assert node.name, f"selector without a metric name in {expr!r}"
                found.add(node.name)

        promql.walk(promql.parse(expr), visit)
        return found

    return names


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    return find_tool("prometheus")


@pytest.fixture(scope="session")
def locust() -> str:
    return find_tool("locust")


@pytest.fixture(scope="session")
def live_gateway(tmp_path_factory):
    """A real `moa-serve serve` (SmolLM2 in the machine's fast dtype, ngram drafter, 1 thread) on 127.0.0.1,
    with an API key.

    Shared by tests/deploy/test_live_*.py so the model loads once; stopped by its pid at the end of the
    session, also when a test failed."""
    from liveprocs import Gateway

    gateway = Gateway(tmp_path_factory.mktemp("gateway"))
    try:
        yield gateway
    finally:
        gateway.stop()
