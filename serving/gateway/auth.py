"""Optional API keys: `Authorization: Bearer <key>`, compared in constant time.

Keys come from MOA_SERVE_API_KEYS (comma list) and/or a file (one key per line, '#' comments),
e.g. a mounted Kubernetes Secret. The file is re-read when it changes (checked at most every
few seconds), so rotating the Secret needs no restart. No keys configured = no authentication.

Tenants: a cache hit is faster than a miss, so a shared prefix cache tells one client what another
sent. Each request's prefix cache (and suffix corpus) namespace is its tenant: a digest of the API key
it authenticated with (when keys are configured) and its `cache_salt` (tenant_key).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from pathlib import Path

from .settings import gateway_settings

RELOAD_CHECK_S = 5.0


def parse_keys(text: str, sep: str = "\n") -> list[str]:
    keys = []
    for raw in text.split(sep):
        k = raw.strip()
        if k and not k.startswith("#"):
            keys.append(k)
    return keys


def key_id(authorization: str) -> str:
    """A stable name for the key of an authenticated request's `Authorization: Bearer <key>` (a digest: the key
    itself is not kept beside the request)."""
    return hashlib.sha256(authorization.partition(" ")[2].strip().encode()).hexdigest()[:32]


def tenant_key(api_key_id: str, cache_salt: str | None) -> str:
    """A request's tenant: "" with neither an API key nor a cache_salt (one namespace for all such requests),
    else a digest of both (a key's requests with different salts, or one salt under different keys, never
    share)."""
    if not api_key_id and cache_salt is None:
        return ""
    return hashlib.sha256(f"{api_key_id}\0{cache_salt or ''}".encode()).hexdigest()[:32]


class APIKeys:
    def __init__(self, keys: list[str] | None = None, file: str | os.PathLike | None = None):
        self._static = [k.encode() for k in keys or []]
        self._file = Path(file) if file else None
        self._file_keys: list[bytes] = []
        self._mtime: float | None = None
        self._checked = 0.0
        self._lock = threading.Lock()
        if self._file is not None:
            if not self._file.is_file():
                raise FileNotFoundError(f"API keys file {self._file} does not exist")
            self._reload(self._file)
            if not self._file_keys and not self._static:
                raise ValueError(f"API keys file {self._file} has no keys")

    @classmethod
    def from_env(cls, file: str | None = None) -> APIKeys:
        s = gateway_settings()
        return cls(list(s.api_keys), file or s.api_keys_file)

    @property
    def enabled(self) -> bool:
        return bool(self._static or self._file is not None)

    def _reload(self, file: Path) -> None:
        st = file.stat()
        if st.st_mtime != self._mtime:
            self._file_keys = [k.encode() for k in parse_keys(file.read_text(encoding="utf-8"))]
            self._mtime = st.st_mtime

    def _keys(self) -> list[bytes]:
        if self._file is not None and time.monotonic() - self._checked > RELOAD_CHECK_S:
            with self._lock:
                self._checked = time.monotonic()
                try:
                    self._reload(self._file)
                except OSError:
                    pass  # keep the last good keys if the file is briefly missing (Secret update)
        return self._static + self._file_keys

    def check(self, authorization: str | None) -> bool:
        """True when the header carries a configured key. Every key is compared (no early exit)."""
        if not authorization:
            return False
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False
        given = token.strip().encode()
        ok = False
        for k in self._keys():
            ok |= hmac.compare_digest(given, k)
        return ok
