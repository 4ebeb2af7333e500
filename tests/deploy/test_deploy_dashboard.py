"""The Grafana dashboard: variables, panels, and every PromQL expression (parsed by promql-parser)."""

from __future__ import annotations

import json
import re

import pytest
from deploytools import DASHBOARD

# Grafana's built-in interval variables, replaced by a duration so the expression parses.
BUILTIN_DURATIONS = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}
REQUIRED_VARIABLES = {"datasource", "namespace", "instance", "drafter"}
# The dashboard's panel list, as words each panel title must contain.
REQUIRED_PANELS = [
    ("acceptance rate", "drafter"),
    ("acceptance length", "drafter"),
    ("draft tokens per step",),
    ("accepted tokens/s",),
    ("throughput", "batch-size"),
    ("time to first token",),
    ("inter-token latency",),
    ("end-to-end latency",),
    ("running", "queued"),
    ("error rate",),
    ("prefix cache", "hit rate"),
    ("requests/s", "tenant"),
    ("tokens/s", "tenant"),
    ("rejections", "tenant"),
    ("queue time", "tenant"),
]


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def targets() -> list[tuple[str, str]]:
    return [(f"{p['title']} [{t['refId']}]", t["expr"]) for p in panels() for t in p["targets"]]


def substitute(expr: str) -> str:
    """What Grafana sends: builtins become durations, template variables (all multi-value regexes) `.*`."""
    for var, value in BUILTIN_DURATIONS.items():
        expr = expr.replace(var, value)
    names = "|".join(REQUIRED_VARIABLES)
    expr = re.sub(rf"\$(?:{{({names})}}|({names})\b)", ".*", expr)
    assert "$" not in expr, f"undefined variable in {expr!r}"
    return expr


def test_template_variables():
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert set(variables) == REQUIRED_VARIABLES
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in REQUIRED_VARIABLES - {"datasource"}:
        v = variables[name]
        assert v["multi"] and v["includeAll"] and v["allValue"] == ".*", name
        assert v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, name


def test_required_panels_present():
    titles = [p["title"].lower() for p in panels()]
    for words in REQUIRED_PANELS:
        assert any(all(w in t for w in words) for t in titles), f"no panel titled with {words}"


def test_panels_use_the_datasource_variable_and_do_not_overlap():
    everything = dashboard()["panels"]
    assert len({p["id"] for p in everything}) == len(everything)
    cells = set()
    for p in everything:
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert g["x"] + g["w"] <= 24 and not cells & mine, f"{p['title']} overlaps"
        cells |= mine
    for p in panels():
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"]), p["title"]


def test_every_expression_parses(promql):
    for where, expr in targets():
        try:
            promql.parse(substitute(expr))
        except ValueError as exc:
            pytest.fail(f"{where}: {exc}\n{expr}")


def test_every_selector_filters_by_the_variables():
    for where, expr in targets():
        for var in ("namespace", "instance", "drafter"):
            wanted = f'{var}=~"${var}"'
            assert expr.count(wanted) == len(re.findall(r"moa_\w+\{", expr)), (
                f"{where}: not every selector has {wanted}"
            )


def test_divisions_are_guarded(promql):
    """Every `/` divides by `(x > 0)`, `clamp_min(x, c > 0)` or a non-zero number: no NaN/Inf on idle servers."""

    def unwrap(node):
        while isinstance(node, promql.ParenExpr):
            node = node.expr
        return node

    def guarded(den) -> bool:
        den = unwrap(den)
        if isinstance(den, promql.NumberLiteral):
            return den.val != 0
        if isinstance(den, promql.Call) and den.func.name == "clamp_min":
            return unwrap(den.args[1]).val > 0
        return (
            isinstance(den, promql.BinaryExpr)
            and str(den.op) == ">"
            and not (den.modifier and den.modifier.return_bool)
            and isinstance(unwrap(den.rhs), promql.NumberLiteral)
            and unwrap(den.rhs).val >= 0
        )

    for where, expr in targets():
        divisions = []
        promql.walk(
            promql.parse(substitute(expr)),
            lambda n, divisions=divisions: (
                divisions.append(n) if isinstance(n, promql.BinaryExpr) and str(n.op) == "/" else None
            ),
        )
        for div in divisions:
            assert guarded(div.rhs), f"{where}: unguarded division by {div.rhs}"


def test_metrics_exist_in_serving_metrics(metric_names, selector_names):
    for where, expr in targets():
        for name in selector_names(substitute(expr)):
            assert name in metric_names, f"{where}: {name} is not exposed by serving/metrics.py"
    for v in dashboard()["templating"]["list"]:
        if v["type"] == "query":
            (name,) = re.findall(r"label_values\((\w+)", v["query"]["query"])
            assert name in metric_names, f"variable {v['name']}: {name}"
