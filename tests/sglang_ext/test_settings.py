"""sglang_ext/settings.py and serving/gateway/settings.py: every MOA_* variable parsed into one frozen Settings (the
core's) or GatewaySettings (API keys, the backend and its upstream), bad values named, reload, and no other product
module reading MOA_* from the environment."""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from serving.gateway.settings import (
    GatewaySettings,
    gateway_settings,
    parse_gateway_settings,
    reload_gateway_settings,
)
from sglang_ext.settings import Settings, SettingsError, parse_settings, reload_settings, settings

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("sglang_ext", "serving", "moa_serve")
PREFIXES = ("MOA_SERVE_", "MOA_SGLANG_")


def test_defaults():
    g = parse_gateway_settings({})
    assert g == GatewaySettings()
    assert g.api_keys == () and g.api_keys_file is None and g.api_key is None
    assert g.backend is None and g.upstream is None and g.upstream_api_key is None
    s = parse_settings({})
    assert s == Settings()
    assert s.cache_dir == Path.home() / ".cache" / "moa-serve"
    assert s.eagle3 is None and s.moa is None and s.eval_dir is None
    assert s.suffix_online and s.cpu_kernels and s.packed_weights and s.avx512 and s.layer_ops
    assert s.kernel_rows is None and s.sglang_tli is None and s.draft_attention == "auto"
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.backend = "sglang"
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.draft_attention = "torch"


def test_each_variable_parsed(tmp_path):
    env = {
        "MOA_SERVE_API_KEYS": " k1, ,k2 ,#off",
        "MOA_SERVE_API_KEYS_FILE": str(tmp_path / "keys"),
        "MOA_SERVE_API_KEY": "client-key",
        "MOA_SERVE_BACKEND": "sglang",
        "MOA_SERVE_UPSTREAM": "http://sglang:30000",
        "MOA_SERVE_UPSTREAM_API_KEY": "up-key",
        "MOA_SERVE_CACHE": str(tmp_path / "cache"),
        "MOA_SERVE_EAGLE3": str(tmp_path / "e3"),
        "MOA_SERVE_MOA": str(tmp_path / "moa"),
        "MOA_SERVE_SUFFIX_ONLINE": "0",
        "MOA_SERVE_EVAL_DIR": str(tmp_path / "eval"),
        "MOA_SERVE_CPU_KERNELS": "0",
        "MOA_SERVE_PACKED_WEIGHTS": "false",
        "MOA_SERVE_AVX512": "off",
        "MOA_SERVE_LAYER_OPS": "no",
        "MOA_SERVE_KERNEL_ROWS": "128",
        "MOA_SGLANG_TLI": "0",
        "MOA_SGLANG_DRAFT_ATTENTION": "triton",
    }
    g, s = parse_gateway_settings(env), parse_settings(env)
    assert g.api_keys == ("k1", "k2")
    assert g.api_keys_file == tmp_path / "keys" and g.api_key == "client-key"
    assert (g.backend, g.upstream, g.upstream_api_key) == ("sglang", "http://sglang:30000", "up-key")
    assert s.cache_dir == tmp_path / "cache" and s.eagle3 == tmp_path / "e3" and s.moa == tmp_path / "moa"
    assert s.eval_dir == tmp_path / "eval"
    assert not (s.suffix_online or s.cpu_kernels or s.packed_weights or s.avx512 or s.layer_ops)
    assert (s.kernel_rows, s.sglang_tli, s.draft_attention) == (128, 0, "triton")
    assert len(env) == len(dataclasses.fields(Settings)) + len(dataclasses.fields(GatewaySettings)), "a field each"
    assert parse_settings({"MOA_SERVE_SUFFIX_ONLINE": "1"}) == Settings()
    assert parse_gateway_settings({"MOA_SERVE_BACKEND": ""}) == GatewaySettings()  # empty = unset


@pytest.mark.parametrize(
    "name,value",
    [
        ("MOA_SERVE_KERNEL_ROWS", "abc"),
        ("MOA_SERVE_KERNEL_ROWS", "0"),
        ("MOA_SERVE_KERNEL_ROWS", "-3"),
        ("MOA_SERVE_KERNEL_ROWS", "2.5"),
        ("MOA_SGLANG_TLI", "one"),
        ("MOA_SGLANG_TLI", "-1"),
        ("MOA_SGLANG_DRAFT_ATTENTION", "cuda"),
        ("MOA_SERVE_BACKEND", "vllm"),
        ("MOA_SERVE_PACKED_WEIGHTS", "2"),
        ("MOA_SERVE_SUFFIX_ONLINE", "maybe"),
    ],
)
def test_bad_value_names_the_variable(name, value):
    parse = parse_gateway_settings if name == "MOA_SERVE_BACKEND" else parse_settings
    with pytest.raises(SettingsError, match=f"{name}={value!r}"):
        parse({name: value})


def test_reload_picks_up_a_change(monkeypatch):
    monkeypatch.delenv("MOA_SERVE_BACKEND", raising=False)
    assert reload_gateway_settings().backend is None
    monkeypatch.setenv("MOA_SERVE_BACKEND", "sglang")
    assert gateway_settings().backend is None  # read once, until reloaded
    assert reload_gateway_settings().backend == "sglang" and gateway_settings() is gateway_settings()
    monkeypatch.setenv("MOA_SERVE_BACKEND", "bogus")
    with pytest.raises(ValueError, match="MOA_SERVE_BACKEND"):
        reload_gateway_settings()
    monkeypatch.delenv("MOA_SGLANG_DRAFT_ATTENTION", raising=False)
    assert reload_settings().draft_attention == "auto"
    monkeypatch.setenv("MOA_SGLANG_DRAFT_ATTENTION", "torch")
    assert settings().draft_attention == "auto"  # read once, until reloaded
    assert reload_settings().draft_attention == "torch" and settings() is settings()
    monkeypatch.setenv("MOA_SGLANG_DRAFT_ATTENTION", "cuda")
    with pytest.raises(ValueError, match="MOA_SGLANG_DRAFT_ATTENTION"):
        reload_settings()
    monkeypatch.delenv("MOA_SGLANG_DRAFT_ATTENTION")
    reload_settings()


def _env_key(node: ast.AST, constants: dict[str, str]) -> str | None:
    """The variable name an os.environ / getenv access reads, when it is a literal or a module constant."""
    key = None
    if isinstance(node, ast.Call) and node.args:
        f = node.func
        on_environ = isinstance(f, ast.Attribute) and "environ" in ast.unparse(f.value)
        if (on_environ and f.attr in ("get", "pop", "setdefault", "__getitem__")) or ast.unparse(f).endswith("getenv"):
            key = node.args[0]
    elif isinstance(node, ast.Subscript) and "environ" in ast.unparse(node.value):
        key = node.slice
    elif isinstance(node, ast.Compare) and any("environ" in ast.unparse(c) for c in node.comparators):
        key = node.left
    if isinstance(key, ast.Constant) and isinstance(key.value, str):
        return key.value
    if isinstance(key, ast.Name):
        return constants.get(key.id)
    return None


def test_only_settings_reads_moa_variables():
    offenders = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path in (ROOT / "sglang_ext" / "settings.py", ROOT / "serving" / "gateway" / "settings.py"):
                continue
            tree = ast.parse(path.read_text(), str(path))
            constants = {
                t.id: n.value.value
                for n in ast.walk(tree)
                if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                for t in n.targets
                if isinstance(t, ast.Name)
            }
            for node in ast.walk(tree):
                key = _env_key(node, constants)
                if key is not None and key.startswith(PREFIXES):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} reads {key}")
    assert not offenders, "read MOA_* through the settings modules:\n" + "\n".join(offenders)


def test_no_module_reads_settings_at_import():
    """Every product module imports with a bad MOA_* value: settings are read on first use, not at import
    (the SGLang plugin is left out: it imports SGLang, and reads its settings only in functions)."""
    script = (
        "import importlib, pkgutil\n"
        "for pkg in ('sglang_ext', 'serving', 'moa_serve'):\n"
        "    for m in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + '.'):\n"
        "        if not m.name.startswith(('sglang_ext.sglang_plugin', 'sglang_ext.kernels._')):\n"
        "            importlib.import_module(m.name)\n"
    )
    env = {**os.environ, "MOA_SERVE_KERNEL_ROWS": "abc", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
