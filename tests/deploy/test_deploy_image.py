"""deploy/Dockerfile cannot be built here (no container engine): check what can be checked without building."""

from __future__ import annotations

import re
import tomllib

import yaml
from deploytools import CHART, ROOT

DOCKERFILE = (ROOT / "deploy" / "Dockerfile").read_text()


def instructions(keyword: str) -> list[str]:
    joined = re.sub(r"\\\n", " ", DOCKERFILE)
    return [line.split(None, 1)[1] for line in joined.splitlines() if line.startswith(keyword + " ")]


def test_copy_sources_exist():
    for args in instructions("COPY"):
        *sources, _dest = args.split()
        for src in sources:
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"


def test_pins_match_requirements():
    required = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (ROOT / "requirements.txt").read_text(), re.M))
    pinned = dict(re.findall(r"([A-Za-z0-9_.-]+)==([0-9][^\s\\]*)", " ".join(instructions("RUN"))))
    assert pinned, "no pinned packages found in the Dockerfile"
    for name, version in pinned.items():
        if name in required:
            assert version == required[name], f"{name}: Dockerfile {version}, requirements.txt {required[name]}"


def test_image_user_matches_the_chart():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    (user,) = instructions("USER")
    for component in ("sglang", "gateway", "router"):
        ctx = values[component]["podSecurityContext"]
        assert user == f"{ctx['runAsUser']}:{ctx['runAsGroup']}", component


def test_versions_agree():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert chart["appVersion"] == values["image"]["tag"] == project
