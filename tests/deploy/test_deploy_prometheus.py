"""Alert and recording rules: promtool's own checks and unit tests, and metric names from serving/metrics.py."""

from __future__ import annotations

import subprocess

import yaml
from deploytools import RULES, RULES_TEST


def rule_groups() -> list[dict]:
    return yaml.safe_load(RULES.read_text())["groups"]


def test_promtool_check_rules(promtool):
    proc = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_promtool_test_rules(promtool):
    proc = subprocess.run([promtool, "test", "rules", str(RULES_TEST)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_each_alert_has_a_firing_and_a_quiet_case():
    alerts = {r["alert"] for g in rule_groups() for r in g["rules"] if "alert" in r}
    assert alerts == {"MoaAcceptanceLengthCollapsed", "MoaQueueGrowing", "MoaHighErrorRate", "MoaKVCacheFull"}
    cases = [c for t in yaml.safe_load(RULES_TEST.read_text())["tests"] for c in t.get("alert_rule_test", [])]
    for alert in alerts:
        expectations = [bool(c["exp_alerts"]) for c in cases if c["alertname"] == alert]
        assert True in expectations, f"{alert}: no test where it fires"
        assert False in expectations, f"{alert}: no test where it stays quiet"


def test_every_alert_has_severity_and_summary():
    for g in rule_groups():
        for r in g["rules"]:
            if "alert" in r:
                assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
                assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]


def test_rule_metrics_exist_in_serving_metrics(metric_names, selector_names):
    records = {r["record"] for g in rule_groups() for r in g["rules"] if "record" in r}
    for g in rule_groups():
        for r in g["rules"]:
            for name in selector_names(r["expr"]):
                assert name in metric_names | records, f"{r.get('alert') or r.get('record')}: unknown metric {name}"


def test_alerts_read_recording_rules_from_earlier_in_their_group(selector_names):
    """Rules of one group run in order; across groups an alert may read a recorded value one interval old
    (this made `promtool test rules` flaky when records and alerts were in separate groups)."""
    for g in rule_groups():
        recorded_so_far: set[str] = set()
        for r in g["rules"]:
            if "alert" in r:
                used = {n for n in selector_names(r["expr"]) if ":" in n}
                assert used <= recorded_so_far, (
                    f"{r['alert']} reads {used - recorded_so_far} from another group or later"
                )
            else:
                recorded_so_far.add(r["record"])
