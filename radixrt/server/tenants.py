"""API keys, the tenants they name and the role they hold: `--api-key` (the default tenant, ""),
`--api-key-file` (`tenant:key[:maxprio]` lines) and `--admin-api-key` (control ops). Shared by the
runtime, the router and the HTTP gateway; needs neither torch nor the engine."""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass, field
from pathlib import Path

from radixrt.protocol import DEFAULT_TENANT_LABEL

DEFAULT_TENANT = ""  # requests without a key file's key: the shared cache
_INT = re.compile(r"[+-]?\d+")


@dataclass(frozen=True)
class Principal:
    """Who sent a message: its tenant, whether it may run control ops (`admin`), and the most
    urgent priority its requests may ask for (None: no cap)."""

    tenant: str = DEFAULT_TENANT
    admin: bool = False
    max_priority: int | None = None


OPEN = Principal(admin=True)  # a server without keys: everyone may do everything (loopback only)


def parse_key_line(line: str) -> tuple[str, str, int | None] | None:
    """`tenant:key` or `tenant:key:maxprio` -> (tenant, key, maxprio). The key is everything
    after the first colon, so keys may hold colons; the third field is read only when the text
    after the last colon is an integer (a key ending in `:<digits>` must now carry the field)."""
    tenant, sep, rest = line.partition(":")
    tenant, rest = tenant.strip(), rest.strip()
    if not sep or not tenant or not rest:
        return None
    key, sep, tail = rest.rpartition(":")
    if sep and key.strip() and _INT.fullmatch(tail.strip()):
        return tenant, key.strip(), int(tail)
    return tenant, rest, None


def load_api_keys(path: str | Path) -> dict[str, Principal]:
    """key -> its tenant (and priority cap) from a file of `tenant:key[:maxprio]` lines (blank
    lines and `#` comments skipped). A ValueError names a bad line, or a tenant named as the
    keyless tenant's stats row is (`default`), whose row it would be shown."""
    keys: dict[str, Principal] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parsed = parse_key_line(line)
        if parsed is None:
            raise ValueError(f"{path}:{number}: expected 'tenant:key' or 'tenant:key:maxprio'")
        tenant, key, max_priority = parsed
        if tenant == DEFAULT_TENANT_LABEL:
            raise ValueError(
                f"{path}:{number}: the tenant name {DEFAULT_TENANT_LABEL!r} is reserved: stats "
                "and /metrics name the keyless (and the admin's) tenant so"
            )
        if key in keys:
            raise ValueError(f"{path}:{number}: a key is listed twice")
        keys[key] = Principal(tenant, admin=False, max_priority=max_priority)
    if not keys:
        raise ValueError(f"{path}: no 'tenant:key' line")
    return keys


@dataclass(frozen=True)
class KeyRing:
    """The keys a server accepts. Empty: every message is accepted, as the admin of the default
    tenant (the server then listens on loopback only, see exposure.check_exposure)."""

    keys: dict[str, Principal] = field(default_factory=dict)

    @classmethod
    def from_settings(
        cls,
        api_key: str | None,
        api_key_file: str | None,
        admin_api_key: str | None = None,
    ) -> KeyRing:
        """`--admin-api-key` is the admin; without it a lone `--api-key` (no key file) still is.
        The admin key names the default tenant, so it may equal `--api-key` but no file key."""
        lone_admin = bool(api_key) and not api_key_file and not admin_api_key
        keys = {api_key: Principal(admin=lone_admin)} if api_key else {}
        if api_key_file:
            keys.update(load_api_keys(api_key_file))
        if admin_api_key:
            if keys.get(admin_api_key, Principal()).tenant != DEFAULT_TENANT:
                raise ValueError("--admin-api-key must not be a key of --api-key-file")
            keys[admin_api_key] = Principal(admin=True)
        return cls(keys)

    def principal_of(self, given: object) -> Principal | None:
        """Who `given` names, None for a missing or wrong key. Every key is compared, in
        constant time each, so the answer's timing says nothing about which key came close."""
        if not self.keys:
            return OPEN
        given_bytes = str(given or "").encode()
        found = None
        for key, principal in self.keys.items():
            if hmac.compare_digest(given_bytes, key.encode()) and found is None:
                found = principal
        return found

    def admin_key(self) -> str | None:
        """A key that may run control ops (None when no key may, or no key is needed)."""
        return next((k for k, p in self.keys.items() if p.admin), None)

    def any_key(self) -> str | None:
        """A key to speak to the server with: the admin's when there is one."""
        return self.admin_key() or next(iter(self.keys), None)


# what a tenant sees of `stats` besides its own row: the server's shape and load (free slots,
# queue lengths), nothing of what other tenants cached, hit, pinned or compiled, nor any timing
TENANT_VISIBLE_STATS = frozenset(
    {
        "tp_size",
        "dp_size",
        "router_policy",
        "total_tokens",
        "free_tokens",
        "host_total_tokens",
        "running",
        "waiting",
        "draining",
        "alive",
    }
)
