"""The product's contracts hold by construction, read from the source with ast (nothing is executed):

- the drafter contract is typed: outside the drafters' own package no code asks a drafter what it is or has
  (getattr / hasattr / isinstance on a drafter, or on any object for a name the Drafter type declares); a
  capability is a declared attribute of drafters/base.py's Drafter, read as one;
- module-private names stay private: no module imports a `_name` from another module;
- the engine is its roles (docs/ARCHITECTURE.md): each in its module, serving/engine.py short, no product file long;
- the results page stays a page.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sglang_ext.drafters.base import Drafter

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("sglang_ext", "serving", "moa_serve")
DRAFTERS = ROOT / "sglang_ext" / "drafters"
PROBES = ("getattr", "hasattr", "isinstance")
# the names the Drafter type declares (capabilities, hooks): asking any object for one is asking a drafter (`name`
# aside: every kind of object has one)
DECLARED = {n for n in vars(Drafter) if not n.startswith("_")} - {"name"}


def _product_files(root: Path = ROOT):
    for pkg in PRODUCT:
        yield from sorted((root / pkg).rglob("*.py"))


def drafter_probes(path: Path, root: Path = ROOT) -> list[str]:
    """`getattr(x, ...)` / `hasattr(x, ...)` / `isinstance(x, ...)` calls in a file that probe a drafter: an argument
    naming a drafter (`self.drafter`, `MoADrafter`), or a getattr / hasattr of a name the Drafter type declares."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PROBES):
            continue
        args = [ast.unparse(a) for a in node.args]
        named = any("drafter" in a.lower() for a in args)
        asked = (
            node.func.id != "isinstance"
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in DECLARED
        )
        if named or asked:
            found.append(f"{path.relative_to(root)}:{node.lineno} {ast.unparse(node)}")
    return found


def private_imports(path: Path, root: Path = ROOT) -> list[str]:
    """`from module import _name` in a file (module another file: a module's own private names are its own)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = package[: len(package) - (node.level - 1)] if node.level else []
        source = ".".join(base + ([node.module] if node.module else []))
        for alias in node.names:
            if alias.name.startswith("_") and not alias.name.startswith("__"):
                found.append(f"{path.relative_to(root)}:{node.lineno} imports {alias.name} from {source}")
    return found


def test_probe_finders_catch_what_they_look_for(tmp_path):
    (tmp_path / "pkg").mkdir()
    f = tmp_path / "pkg" / "m.py"
    f.write_text(
        "from .other import _hidden, shown\n"
        "a = getattr(self.drafter, 'needs_commit', True)\n"
        "b = isinstance(d, MoADrafter)\n"
        "c = hasattr(x, 'drop_prefix')\n"
        "d = getattr(tokenizer, 'eos_token_id', None)\n"
    )
    probes = drafter_probes(f, tmp_path)
    assert [p.split(" ", 1)[0].rsplit(":", 1)[1] for p in probes] == ["2", "3", "4"]
    assert private_imports(f, tmp_path) == ["pkg/m.py:1 imports _hidden from pkg.other"]


def test_no_drafter_is_probed_outside_the_drafters_package():
    found = [p for path in _product_files() if DRAFTERS not in path.parents for p in drafter_probes(path)]
    assert found == [], "declare the capability on sglang_ext/drafters/base.py's Drafter:\n" + "\n".join(found)


def test_no_module_imports_another_modules_private_name():
    found = [p for path in _product_files() for p in private_imports(path)]
    assert found == [], "make the name public, or keep it in its module:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "module",
    ["scheduler", "kv_manager", "model_runner", "spec_worker", "sampler", "request", "engine", "engine_loop"],
)
def test_the_engine_roles_are_modules(module):
    assert (ROOT / "serving" / f"{module}.py").is_file()


def test_no_long_product_files():
    lines = {p.relative_to(ROOT): len(p.read_text().splitlines()) for p in _product_files()}
    assert lines[Path("serving/engine.py")] <= 400
    assert {str(p): n for p, n in lines.items() if n > 600} == {}


def test_the_results_page_keeps_the_latest_result_per_axis_only():
    """docs/BENCHMARKS.md: the latest measurement of each axis (older ones live in its git history)."""
    assert len((ROOT / "docs" / "BENCHMARKS.md").read_text().splitlines()) <= 400
