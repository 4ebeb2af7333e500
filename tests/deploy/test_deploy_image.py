"""deploy/Dockerfile cannot be built here (no container engine): what can be checked without building or
replaying it (test_image_replay.py replays its install)."""

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


def test_pins_are_the_locks():
    """A version the Dockerfile pins is the one constraints.txt pins (the lock is the one source of versions)."""
    norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
    lines = [ln.split("#")[0].strip() for ln in (ROOT / "constraints.txt").read_text().splitlines()]
    lock = {norm(n): v for n, v in (ln.split("==") for ln in lines if ln)}
    pinned = dict(re.findall(r"([A-Za-z0-9_.-]+)==([0-9][^\s\\]*)", " ".join(instructions("RUN"))))
    assert pinned, "no pinned packages found in the Dockerfile"
    for name, version in pinned.items():
        assert lock.get(norm(name)) == version, f"{name}: Dockerfile {version}, constraints.txt {lock.get(norm(name))}"


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
