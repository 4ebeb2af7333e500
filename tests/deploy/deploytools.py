"""Paths and tool wrappers shared by the deploy tests (a uniquely named module: `conftest` is ambiguous
when several test directories have one)."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm"
DASHBOARD = ROOT / "deploy" / "grafana" / "moa-serve-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "rules.yaml"
RULES_TEST = ROOT / "deploy" / "prometheus" / "rules_test.yaml"
VALUES_FILES = {
    "default": None,
    "h100-production": CHART / "ci" / "h100-production.yaml",
    "multi-replica-autoscale-monitoring": CHART / "ci" / "multi-replica-autoscale-monitoring.yaml",
    "moa-trained": CHART / "ci" / "moa-trained.yaml",
    "moa-training-job": CHART / "ci" / "moa-training-job.yaml",
}
INSTALL_HINT = "run scripts/install-deploy-tools.sh"


def find_tool(name: str) -> str:
    """The tool from the project's .tools/bin, the venv's bin, or PATH; else skip the test."""
    for candidate in (ROOT / ".tools" / "bin" / name, Path(sys.executable).parent / name):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(name)
    if not found:
        pytest.skip(f"{name} not installed ({INSTALL_HINT})")
    return found


class Helm:
    def __init__(self, binary: str, home: Path):
        self.binary = binary
        self.env = {**os.environ, **{f"HELM_{k}_HOME": str(home / k.lower()) for k in ("CACHE", "CONFIG", "DATA")}}

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([self.binary, *args], capture_output=True, text=True, env=self.env, timeout=60)

    def template(self, *args: str) -> subprocess.CompletedProcess:
        return self.run("template", "moa", str(CHART), "--namespace", "llm", *args)

    @functools.cache  # noqa: B019 - one Helm per session (a fixture): the cache lives as long as it does
    def render(self, *args: str) -> tuple[dict, ...]:
        """Rendered objects for `helm template` with these extra args (cached: templates are pure)."""
        proc = self.template(*args)
        assert proc.returncode == 0, proc.stderr
        return tuple(d for d in yaml.safe_load_all(proc.stdout) if d)

    def render_values(self, name: str, *extra: str) -> tuple[dict, ...]:
        path = VALUES_FILES[name]
        return self.render(*(("-f", str(path)) if path else ()), *extra)
