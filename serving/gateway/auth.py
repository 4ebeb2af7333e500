"""Optional API keys: `Authorization: Bearer <key>`, compared in constant time.

Keys come from MOA_SERVE_API_KEYS (comma list) and/or a file (one key per line, '#' comments),
e.g. a mounted Kubernetes Secret. A key may name its tenant, weight and limits after it
(serving/tenancy.py: `sk-... tenant=team-a weight=2 max_queued=32`); a plain key is its own tenant.
The file is re-read when it changes (checked at most every few seconds), so rotating the Secret needs
no restart; a changed file with an error keeps the last good keys (the error is logged, by line). No
keys configured = no authentication, and every request is one tenant.

Tenants for fairness are the keys' (APIKeys.tenant_of). The prefix cache's namespace is a different, finer
thing: a cache hit is faster than a miss, so a shared prefix cache tells one client what another sent. Each
request's prefix cache (and suffix corpus) namespace is a digest of the API key it authenticated with (when
keys are configured) and its `cache_salt` (tenant_key).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from pathlib import Path

from ..tenancy import Tenant, TenantsFileError, parse_keys
from .settings import gateway_settings

log = logging.getLogger(__name__)

RELOAD_CHECK_S = 5.0


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
    """keys: MOA_SERVE_API_KEYS's entries (each `key [fields]`, tenants env-key<N> when unnamed); file: the keys
    file (tenants key<N> when unnamed). Raises TenantsFileError (a ValueError naming the line) or
    FileNotFoundError."""

    def __init__(self, keys: list[str] | None = None, file: str | os.PathLike | None = None):
        self._static = _encoded(parse_keys(list(keys or []), "MOA_SERVE_API_KEYS", prefix="env-key", unit="entry"))
        self._file = Path(file) if file else None
        self._file_keys: list[tuple[bytes, Tenant]] = []
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
            self._mtime = st.st_mtime  # (a bad file is reported once, not at every check)
            entries = _encoded(parse_keys(file.read_text(encoding="utf-8").splitlines(), f"API keys file {file}"))
            static = {k for k, _ in self._static}
            for n, (k, _) in enumerate(entries, 1):
                if k in static:
                    raise TenantsFileError(f"API keys file {file}: its key number {n} is also in MOA_SERVE_API_KEYS")
            self._file_keys = entries

    def _keys(self) -> list[tuple[bytes, Tenant]]:
        if self._file is not None and time.monotonic() - self._checked > RELOAD_CHECK_S:
            with self._lock:
                self._checked = time.monotonic()
                try:
                    self._reload(self._file)
                except OSError:
                    pass  # keep the last good keys if the file is briefly missing (Secret update)
                except TenantsFileError as e:
                    log.error("%s; keeping the keys read before", e)
        return self._static + self._file_keys

    def tenant_names(self) -> list[str]:
        """The tenants the configured keys name (each once, in file order)."""
        return list(dict.fromkeys(t.name for _, t in self._keys()))

    def tenant_of(self, authorization: str | None) -> Tenant | None:
        """The tenant of the key `Authorization: Bearer <key>` carries, None when it carries no configured key.
        Every key is compared (no early exit)."""
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        given = token.strip().encode()
        found = None
        for k, tenant in self._keys():
            if hmac.compare_digest(given, k):
                found = tenant
        return found

    def check(self, authorization: str | None) -> bool:
        """True when the header carries a configured key."""
        return self.tenant_of(authorization) is not None


def _encoded(entries: list[tuple[str, Tenant]]) -> list[tuple[bytes, Tenant]]:
    return [(k.encode(), t) for k, t in entries]
