"""The core's MOA_* environment variables, read and checked in one place (the gateway's own, API keys and the
upstream backend, are serving/gateway/settings.py's, parsed with the readers here).

`settings()` parses os.environ on first use and returns the same frozen `Settings` for the rest of the
process; `reload_settings()` parses it again (tests that change the environment). No module reads these
variables at import time. A bad value raises SettingsError (a ValueError) naming the variable. An empty
value counts as unset. Switches take 1/0 (also true/false, yes/no, on/off).

Models and drafters:
    MOA_SERVE_CACHE             where converted GGUF targets are cached (default ~/.cache/moa-serve)
    MOA_SERVE_EAGLE3            EAGLE-3 checkpoint dir used instead of the shipped one
    MOA_SERVE_MOA               MoA checkpoint dir used for `--drafter moa` instead of the shipped one
    MOA_SERVE_SUFFIX_ONLINE     0: the suffix drafter does not learn from served outputs (default 1)
    MOA_SERVE_EVAL_DIR          directory of the eval-set jsonl files (default ../shared/data/eval)
CPU kernels (chosen once, on the kernels' first use):
    MOA_SERVE_CPU_KERNELS       0: no CPU kernels at all, torch ops everywhere (default 1)
    MOA_SERVE_PACKED_WEIGHTS    0: the kernels read the fp32 weights, not the GGUF blocks (default 1)
    MOA_SERVE_AVX512            0: the AVX2 tiles even where the CPU has AVX-512 (default 1)
    MOA_SERVE_LAYER_OPS         0: torch ops for a decoder layer's norms, RoPE and SiLU (CPU and GPU; default 1)
    MOA_SERVE_KERNEL_ROWS       positive integer: forwards of more rows go to F.linear (default 24 where
                                the AVX-512 tiles run, else 128)
SGLang plugin:
    MOA_SGLANG_TLI              integer >= 0: the target layer the MoA drafter reads, overriding the
                                checkpoint's (checked against the target's layer count there)
    MOA_SGLANG_DRAFT_ATTENTION  auto | flashinfer | triton | cpu | torch: the draft passes' attention backend
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

DRAFT_ATTENTION = ("auto", "flashinfer", "triton", "cpu", "torch")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class SettingsError(ValueError):
    """A MOA_* environment variable has a value that cannot be used; the message names it."""


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "moa-serve"


@dataclass(frozen=True)
class Settings:
    """One typed field per variable (see the module docstring); None = unset."""

    cache_dir: Path = field(default_factory=_default_cache_dir)
    eagle3: Path | None = None
    moa: Path | None = None
    suffix_online: bool = True
    eval_dir: Path | None = None
    cpu_kernels: bool = True
    packed_weights: bool = True
    avx512: bool = True
    layer_ops: bool = True
    kernel_rows: int | None = None
    sglang_tli: int | None = None
    draft_attention: str = "auto"


def env_text(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name, "").strip()
    return value or None


def env_switch(env: Mapping[str, str], name: str, default: bool) -> bool:
    value = env_text(env, name)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise SettingsError(f"{name}={value!r}: use 1 or 0")


def env_path(env: Mapping[str, str], name: str) -> Path | None:
    value = env_text(env, name)
    return Path(value).expanduser() if value is not None else None


def env_int(env: Mapping[str, str], name: str, least: int, what: str) -> int | None:
    value = env_text(env, name)
    if value is None:
        return None
    if not value.isdigit() or int(value) < least:
        raise SettingsError(f"{name}={value!r}: must be {what}")
    return int(value)


def env_choice(env: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str | None:
    value = env_text(env, name)
    if value is not None and value not in choices:
        raise SettingsError(f"{name}={value!r}: choose {', '.join(choices)}")
    return value


def parse_settings(env: Mapping[str, str]) -> Settings:
    """The Settings an environment gives; SettingsError names the first bad variable."""
    return Settings(
        cache_dir=env_path(env, "MOA_SERVE_CACHE") or _default_cache_dir(),
        eagle3=env_path(env, "MOA_SERVE_EAGLE3"),
        moa=env_path(env, "MOA_SERVE_MOA"),
        suffix_online=env_switch(env, "MOA_SERVE_SUFFIX_ONLINE", True),
        eval_dir=env_path(env, "MOA_SERVE_EVAL_DIR"),
        cpu_kernels=env_switch(env, "MOA_SERVE_CPU_KERNELS", True),
        packed_weights=env_switch(env, "MOA_SERVE_PACKED_WEIGHTS", True),
        avx512=env_switch(env, "MOA_SERVE_AVX512", True),
        layer_ops=env_switch(env, "MOA_SERVE_LAYER_OPS", True),
        kernel_rows=env_int(env, "MOA_SERVE_KERNEL_ROWS", 1, "a positive integer"),
        sglang_tli=env_int(env, "MOA_SGLANG_TLI", 0, "an integer >= 0 (a target layer)"),
        draft_attention=env_choice(env, "MOA_SGLANG_DRAFT_ATTENTION", DRAFT_ATTENTION) or "auto",
    )


@functools.cache
def settings() -> Settings:
    """The process-wide Settings, parsed from os.environ on first use."""
    return parse_settings(os.environ)


def reload_settings() -> Settings:
    """Parses os.environ again (after a test changed it) and returns the new Settings."""
    settings.cache_clear()
    return settings()
