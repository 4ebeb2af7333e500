"""What the package declares (pyproject.toml) against what its code imports, what the lock (constraints.txt) pins
and what the commands need: every third-party import is declared (the core or an extra), the lock pins every
declared distribution inside its range, and every command's --help needs only the core (a command run without
its extra is one line naming the extra)."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
PACKAGES = ("sglang_ext", "serving", "moa_serve")
RUNTIME_EXTRAS = ("serve", "train", "bench", "sglang")
# imported only where present, never needed: each with where it comes from
OPTIONAL_IMPORTS = {
    "triton": "torch's own requirement on Linux x86-64; the Triton kernels check find_spec first",
    "flashinfer": "the SGLang image's attention library; sglang_plugin/tree_attention.py uses it when present",
    "llama_cpp": "the llama.cpp peer of `moa-serve bench` (`make bench-peers` builds it)",
}
IMAGE_ONLY = {"sglang-router"}  # pinned for deploy/Dockerfile; not installed by `make install`


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> dict[str, list[Requirement]]:
    """{"": core requirements, extra: its requirements (self-references like moa-serve[serve] left out)}."""
    out = {"": [Requirement(r) for r in PROJECT["dependencies"]]}
    for extra, reqs in PROJECT["optional-dependencies"].items():
        out[extra] = [r for r in map(Requirement, reqs) if norm(r.name) != "moa-serve"]
    return out


def lock() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            assert norm(name) not in pins, f"constraints.txt pins {name} twice"
            pins[norm(name)] = version.strip()
    return pins


def third_party_imports() -> dict[str, set[str]]:
    """Top-level module -> files that import it (function-local imports included), outside the stdlib."""
    found: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in PACKAGES:
                        found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_third_party_import_is_declared():
    names = {norm(r.name) for reqs in declared().values() for r in reqs}
    dists_of = importlib.metadata.packages_distributions()
    undeclared = {}
    for module, files in third_party_imports().items():
        if module in OPTIONAL_IMPORTS:
            continue
        dists = {norm(d) for d in dists_of.get(module, [])}
        if not dists & names:
            undeclared[module] = (sorted(dists) or "not installed here", sorted(files)[:3])
    assert not undeclared, f"imported but declared nowhere in pyproject.toml: {undeclared}"


def test_the_lock_pins_every_declared_requirement_in_its_range():
    pins = lock()
    for extra, reqs in declared().items():
        for r in reqs:
            assert norm(r.name) in pins, f"{r} ({extra or 'core'}) is not in constraints.txt"
            assert r.specifier.contains(Version(pins[norm(r.name)]), prereleases=True), (
                f"constraints.txt {r.name}=={pins[norm(r.name)]} is outside pyproject's {r} ({extra or 'core'})"
            )


def test_the_lock_is_what_make_install_installed():
    """The venv running the tests was installed through the lock (`make install` reinstalls when it changes)."""
    wrong = {}
    for name, version in lock().items():
        if name in IMAGE_ONLY:
            continue
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            have = None
        if have is None or Version(have).public != Version(version).public:
            wrong[name] = (have, version)
    assert not wrong, f"installed vs constraints.txt: {wrong} (run make install)"


def test_sglang_extra_is_the_version_the_plugin_is_written_for():
    (req,) = declared()["sglang"]
    assert norm(req.name) == "sglang" and str(req.specifier) == f"=={lock()['sglang']}"


BLOCKED_RUN = """
import importlib.abc, json, sys
BLOCK = set(sys.argv[1].split(","))

class Block(importlib.abc.MetaPathFinder):  # what a venv without these distributions does on import
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCK:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Block())
import sglang_ext, sglang_ext.drafters, sglang_ext.models, serving.engine  # the core: the engine
from moa_serve.entrypoints.cli import build_parser, main

def commands(parser, prefix=()):
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        for name, sub in action.choices.items():
            yield (*prefix, name)
            yield from commands(sub, (*prefix, name))

codes = {}
for cmd in [()] + list(commands(build_parser())):
    try:
        main([*cmd, "--help"])
    except SystemExit as e:
        codes[" ".join(cmd)] = e.code
print(json.dumps(codes))
"""


def _runtime_modules() -> set[str]:
    """The import names of every distribution that a runtime extra declares (dist name with '_' for '-')."""
    return {norm(r.name).replace("-", "_") for e in RUNTIME_EXTRAS for r in declared()[e]}


def test_every_command_help_needs_only_the_core(tmp_path):
    blocked = _runtime_modules()
    assert {"fastapi", "uvicorn", "tensorboard", "matplotlib", "sglang"} <= blocked
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKED_RUN, ",".join(sorted(blocked))],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"serve", "train", "train moa", "distill", "bench", "edge", "edge-bench"} <= set(codes)
    assert all(code == 0 for code in codes.values()), codes


def test_a_command_without_its_extra_names_it(tmp_path):
    """`moa-serve serve` where the `serve` extra is missing: one line, exit 2, the pip command to run."""
    code = BLOCKED_RUN.split("def commands")[0] + "sys.exit(main(['serve', '--model', 'smollm2']))\n"
    blocked = {norm(r.name).replace("-", "_") for r in declared()["serve"]}
    proc = subprocess.run(
        [sys.executable, "-c", code, ",".join(sorted(blocked))], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert (
        lines[0].startswith("moa-serve serve: error: needs the 'serve' extra")
        and "pip install 'moa-serve[serve]'" in lines[0]
    )


def test_each_extra_distribution_imports_by_its_name():
    """The command-edge check (cli.missing_extra) finds a declared distribution by its name with '_' for '-'."""
    import importlib.util

    for module in sorted(_runtime_modules()):
        assert importlib.util.find_spec(module) is not None, module
