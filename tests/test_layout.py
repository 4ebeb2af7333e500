"""The import graph of the product packages. Dependencies run one way, each layer importing only the
layers below it: `sglang_ext` (the speculative core) <- `serving` (engine, scheduler, backends, gateway,
edge) <- `moa_serve.benchmarks` <- `moa_serve.entrypoints` (the `moa-serve` command line); and no two
top-level modules import each other in a circle, nor do any two files.

Imports are read with ast (nothing is executed), function-local imports included: a lazy import is still
a dependency. A module's top-level module is its layer and one dotted part more (`serving.gateway.app` ->
`serving.gateway`, `sglang_ext.training.distill` -> `sglang_ext.training`,
`moa_serve.benchmarks.gpu_job.sections` -> `moa_serve.benchmarks.gpu_job`; a plain file such as
`serving/engine.py` is `serving.engine`).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("sglang_ext", "serving", "moa_serve.benchmarks", "moa_serve.entrypoints")  # lowest layer first


def _layer(module: str) -> str | None:
    """The layer (an entry of PACKAGES) a dotted module name belongs to, or None."""
    return next((p for p in PACKAGES if module == p or module.startswith(p + ".")), None)


def _files(pkg: str):
    return (ROOT / pkg.replace(".", "/")).rglob("*.py")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Dotted names of the project modules a file imports (relative imports resolved)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            out.add(prefix)
            out.update(f"{prefix}.{a.name}" for a in node.names)  # `from pkg import module`
    return {m for m in out if _layer(m) is not None}


def _top(module: str) -> str:
    depth = len(_layer(module).split(".")) + 1
    return ".".join(module.split(".")[:depth])


def _graph() -> dict[str, set[str]]:
    """top-level module -> the top-level modules it imports (itself excluded)."""
    known = {_top(_module_name(p)) for pkg in PACKAGES for p in _files(pkg)}
    graph: dict[str, set[str]] = {m: set() for m in known}
    for pkg in PACKAGES:
        for path in _files(pkg):
            src = _top(_module_name(path))
            graph[src].update(t for t in map(_top, _imports(path)) if t in known and t != src)
    return graph


def _file_graph() -> dict[str, set[str]]:
    """module (one file) -> the modules it imports (each import resolved to the longest module name it
    starts with: `from ..models.checkpoint import MOA` -> sglang_ext.models.checkpoint; a package's
    __init__ is the package's name)."""
    known = {_module_name(p) for pkg in PACKAGES for p in _files(pkg)}
    graph: dict[str, set[str]] = {m: set() for m in known}
    for pkg in PACKAGES:
        for path in _files(pkg):
            src = _module_name(path)
            for name in _imports(path):
                parts = name.split(".")
                hit = next(
                    (".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in known), None
                )
                if hit is not None and hit != src:
                    graph[src].add(hit)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _upward_imports() -> list[str]:
    """Imports of a module from a layer above its own."""
    rank = {pkg: i for i, pkg in enumerate(PACKAGES)}
    return sorted(
        {
            f"{path.relative_to(ROOT)} imports {_top(m)}"
            for pkg in PACKAGES
            for path in _files(pkg)
            for m in _imports(path)
            if rank[_layer(m)] > rank[pkg]
        }
    )


def test_graph_helpers_find_a_cycle_and_resolve_relative_imports(tmp_path):
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert "serving.engine" in _imports(ROOT / "serving" / "engine_loop.py")  # `from .engine import ...`
    assert "serving.api.errors" in _imports(ROOT / "serving" / "gateway" / "app.py")  # `from ..api.errors ...`


def test_layers_import_only_the_layers_below():
    assert _upward_imports() == []


def test_no_import_cycles_between_top_level_modules():
    assert _cycles(_graph()) == []


def test_no_import_cycles_between_files():
    """Inside a top-level module too (e.g. a plugin's registration and its worker): options and names go
    below both, and imports run one way."""
    graph = _file_graph()
    assert "sglang_ext.sglang_plugin.options" in graph["sglang_ext.sglang_plugin.worker"]
    assert _cycles(graph) == []


def test_the_longest_first_test_files_exist():
    """conftest's LONGEST_FIRST orders the xdist run; a renamed file would silently drop out of it. (Read from
    the file: `import conftest` may find another directory's conftest first.)"""
    tests = Path(__file__).parent
    tree = ast.parse((tests / "conftest.py").read_text())
    value = next(
        n.value for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "LONGEST_FIRST"
    )
    names = ast.literal_eval(value)
    assert len(names) > 10 and [f for f in names if not (tests / f).is_file()] == []
