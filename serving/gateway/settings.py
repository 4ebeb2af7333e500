"""The gateway's MOA_SERVE_* environment variables (API keys, the backend and its upstream), read and checked in one
place, as sglang_ext/settings.py reads the core's (same rules: parsed on first use, a bad value is a SettingsError
naming the variable, empty = unset).

    MOA_SERVE_API_KEYS          comma list of API keys the gateway accepts (Authorization: Bearer)
    MOA_SERVE_API_KEYS_FILE     file of API keys, one a line, '#' comments; re-read when it changes
    MOA_SERVE_API_KEY           the key `moa-serve edge` / `moa-serve bench edge` send (default of their --api-key)
    MOA_SERVE_BACKEND           embedded | sglang: the default of `moa-serve serve --backend`
    MOA_SERVE_UPSTREAM          upstream SGLang base URL for the sglang backend (default of --upstream)
    MOA_SERVE_UPSTREAM_API_KEY  key the gateway sends to the upstream SGLang server
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sglang_ext.settings import env_choice, env_path, env_text

BACKENDS = ("embedded", "sglang")


@dataclass(frozen=True)
class GatewaySettings:
    """One typed field per variable (see the module docstring); None = unset."""

    api_keys: tuple[str, ...] = ()
    api_keys_file: Path | None = None
    api_key: str | None = None
    backend: str | None = None
    upstream: str | None = None
    upstream_api_key: str | None = None


def parse_gateway_settings(env: Mapping[str, str]) -> GatewaySettings:
    """The GatewaySettings an environment gives; SettingsError names the first bad variable."""
    keys = tuple(k.strip() for k in env.get("MOA_SERVE_API_KEYS", "").split(","))
    return GatewaySettings(
        api_keys=tuple(k for k in keys if k and not k.startswith("#")),
        api_keys_file=env_path(env, "MOA_SERVE_API_KEYS_FILE"),
        api_key=env_text(env, "MOA_SERVE_API_KEY"),
        backend=env_choice(env, "MOA_SERVE_BACKEND", BACKENDS),
        upstream=env_text(env, "MOA_SERVE_UPSTREAM"),
        upstream_api_key=env_text(env, "MOA_SERVE_UPSTREAM_API_KEY"),
    )


@functools.cache
def gateway_settings() -> GatewaySettings:
    """The process-wide GatewaySettings, parsed from os.environ on first use."""
    return parse_gateway_settings(os.environ)


def reload_gateway_settings() -> GatewaySettings:
    """Parses os.environ again (after a test changed it) and returns the new GatewaySettings."""
    gateway_settings.cache_clear()
    return gateway_settings()
