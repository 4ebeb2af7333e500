"""Fresh venvs for the packaging and image tests: a new interpreter environment whose only pre-existing layer is a
chosen set of installed distributions (the heavy part that a user, or the SGLang base image, already has),
made visible through a .pth file, with everything else installed into it by pip, offline, from the wheelhouse
that `make install` downloads (scripts/wheelhouse.py, at the versions of constraints.txt).

    layer = preinstalled_layer(tmp / "layer", ["torch"])   # torch and what it requires, as installed here
    py = fresh_venv(tmp / "venv", layer)                   # `python -m venv`, plus layer.pth
    pip_install(py, "moa_serve-0.1.0-py3-none-any.whl[serve]")

A distribution of the layer is linked, not copied (its top-level files from its RECORD, and its console
scripts written into the venv's bin/): a 5 GB CUDA torch costs nothing. pip sees the layer's distributions as
installed (importlib.metadata reads every sys.path entry) and leaves them as they are when they satisfy what
it installs; anything else comes from the wheelhouse or the install fails.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
WHEELHOUSE = Path(sys.prefix) / "wheelhouse"  # `make install`: scripts/wheelhouse.py $(VENV)/wheelhouse
CONSTRAINTS = ROOT / "constraints.txt"


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_closure(roots: list[str]) -> tuple[list[importlib.metadata.Distribution], list[str]]:
    """The installed distributions of `roots` and of everything they require (markers evaluated here, extras
    followed), and the names required but not installed here."""
    found: dict[str, importlib.metadata.Distribution] = {}
    missing: set[str] = set()
    todo, seen = [(Requirement(r), "") for r in roots], set()
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        key = (norm(req.name), tuple(sorted(req.extras)))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = importlib.metadata.distribution(req.name)
        except importlib.metadata.PackageNotFoundError:
            missing.add(norm(req.name))
            continue
        found[norm(req.name)] = dist
        for child in map(Requirement, dist.requires or []):
            todo.extend((child, ex) for ex in (req.extras or {""}))
    return list(found.values()), sorted(missing)


def _top_level(dist: importlib.metadata.Distribution) -> set[Path]:
    """The site-packages entries a distribution installed (packages, modules, its .dist-info)."""
    site = Path(dist.locate_file(""))
    tops = set()
    for f in dist.files or ():
        parts = Path(f).parts
        if parts and parts[0] != ".." and not parts[0].endswith(".pth"):
            tops.add(site / parts[0])
    return tops


def preinstalled_layer(dest: Path, roots: list[str]) -> tuple[Path, list[importlib.metadata.Distribution]]:
    """A directory of links to the installed closure of `roots`: what a fresh venv starts with."""
    dest.mkdir(parents=True)
    dists, _ = installed_closure(roots)
    for dist in dists:
        for top in _top_level(dist):
            link = dest / top.name
            if top.exists() and not link.exists():
                link.symlink_to(top)
    return dest, dists


def fresh_venv(path: Path, layer: tuple[Path, list] | None = None) -> Path:
    """A new venv (no pip in it: the host's pip installs into it with --python) seeing `layer`; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    site = next((path / "lib").glob("python3*/site-packages"))
    if layer is not None:
        layer_dir, dists = layer
        (site / "preinstalled.pth").write_text(f"{layer_dir}\n")
        for dist in dists:  # their console scripts (torchrun, ...), as an install would write them
            for ep in dist.entry_points.select(group="console_scripts"):
                module, _, attr = ep.value.partition(":")
                script = path / "bin" / ep.name
                script.write_text(
                    f"#!{python}\nimport sys\nfrom {module} import {attr.split('.')[0]}\nsys.exit({attr}())\n"
                )
                script.chmod(0o755)
    return python


def pip_install(python: Path, *args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 300):
    """`pip install` into the venv of `python`, offline from the wheelhouse. --no-compile: the modules a test
    imports are compiled when imported, not the thousands it never does (transformers alone: ~10 s here)."""
    if not WHEELHOUSE.is_dir():
        raise AssertionError(f"no wheelhouse at {WHEELHOUSE}: run `make install` (scripts/wheelhouse.py)")
    cmd = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index", "--find-links"]
    return subprocess.run(
        [*cmd, str(WHEELHOUSE), "--no-cache-dir", "--no-compile", "--disable-pip-version-check", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def tracked_copy(dest: Path, paths: list[str] | None = None) -> Path:
    """The files a clone of this working tree has (tracked and new, nothing ignored), or only those under `paths`."""
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", *(paths or [])],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        src = ROOT / name.decode()
        if src.is_file():
            (dest / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name.decode())
    return dest


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for a command in a fresh venv: no PYTHONPATH (nothing from this checkout), one thread."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(OMP_NUM_THREADS="1", PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)
    return env
