"""API keys and the tenants they name: `--api-key` (the default tenant, "") and `--api-key-file`
(`tenant:key` lines). Shared by the runtime and the HTTP gateway; needs neither torch nor the
engine."""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_TENANT = ""  # requests without a key file's key: the shared cache


def load_api_keys(path: str | Path) -> dict[str, str]:
    """key -> tenant from a file of `tenant:key` lines (blank lines and `#` comments skipped;
    the key is everything after the first colon). A ValueError names a bad line."""
    keys: dict[str, str] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        tenant, sep, key = line.partition(":")
        tenant, key = tenant.strip(), key.strip()
        if not sep or not tenant or not key:
            raise ValueError(f"{path}:{number}: expected 'tenant:key'")
        if key in keys:
            raise ValueError(f"{path}:{number}: a key is listed twice")
        keys[key] = tenant
    if not keys:
        raise ValueError(f"{path}: no 'tenant:key' line")
    return keys


@dataclass(frozen=True)
class KeyRing:
    """The keys a server accepts. Empty: every message is accepted, as the default tenant."""

    keys: dict[str, str] = field(default_factory=dict)  # key -> tenant

    @classmethod
    def from_settings(cls, api_key: str | None, api_key_file: str | None) -> KeyRing:
        keys = {api_key: DEFAULT_TENANT} if api_key else {}
        keys.update(load_api_keys(api_key_file) if api_key_file else {})
        return cls(keys)

    def tenant_of(self, given: object) -> str | None:
        """The tenant `given` names, None for a missing or wrong key. Every key is compared, in
        constant time each, so the answer's timing says nothing about which key came close."""
        if not self.keys:
            return DEFAULT_TENANT
        given_bytes = str(given or "").encode()
        found = None
        for key, tenant in self.keys.items():
            if hmac.compare_digest(given_bytes, key.encode()) and found is None:
                found = tenant
        return found

    def any_key(self) -> str | None:
        """A key to speak to the server with (the gateway's own control calls)."""
        return next(iter(self.keys), None)
