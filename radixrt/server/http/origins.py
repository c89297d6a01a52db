"""`SitePolicy`: which browsers' requests a keyless gateway answers.

A gateway without keys listens on loopback only (exposure checks), yet a web page the operator
opens can still make the browser send it requests: a cross-site form or image (`GET`, or a
`text/plain` `POST`) with no preflight, or, after DNS rebinding, a page whose own name resolves
to 127.0.0.1 and whose requests then look same-origin to the browser. So a keyless gateway
refuses a request whose `Host` is not a name of the bound address (rebinding: the attacker's
name is in it), and one whose `Origin` (or, where a browser sends no Origin, `Sec-Fetch-Site`)
says another site sent it. `--allowed-hosts` / `--allowed-origins` widen the sets (`*`: any).
With keys, the key is the guard: a browser cannot attach it cross-site without a CORS preflight,
which this server never grants.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})


def host_name(authority: str) -> str:
    """`Host`'s name without its port: `[::1]:30000` -> `::1`, `localhost:30000` -> `localhost`."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        return authority[1 : authority.find("]")] if "]" in authority else authority
    return authority.rsplit(":", 1)[0] if authority.count(":") == 1 else authority


@dataclass(frozen=True)
class SitePolicy:
    """The Host names and Origins a keyless gateway accepts (see the module docstring)."""

    hosts: frozenset[str]
    origins: frozenset[str]

    @classmethod
    def of(
        cls, bound_host: str, allowed_hosts: tuple[str, ...], allowed_origins: tuple[str, ...]
    ) -> SitePolicy:
        """The bound address's names (loopback's, when it is loopback) and the operator's."""
        names = {bound_host.lower(), *(h.lower() for h in allowed_hosts)}
        if bound_host in LOOPBACK_NAMES:
            names |= LOOPBACK_NAMES
        return cls(frozenset(names), frozenset(o.rstrip("/").lower() for o in allowed_origins))

    def refusal(self, headers: dict[bytes, bytes]) -> str | None:
        """Why a request with these headers is refused, None when it is not."""
        host = headers.get(b"host", b"").decode("latin-1")
        if host and "*" not in self.hosts and host_name(host) not in self.hosts:
            return f"Host {host!r} is not this server's name (--allowed-hosts to add it)"
        origin = headers.get(b"origin", b"").decode("latin-1").strip()
        if origin:
            if self._origin_allowed(origin):
                return None
            return f"Origin {origin!r} is another site (--allowed-origins to add it)"
        if headers.get(b"sec-fetch-site", b"") == b"cross-site" and "*" not in self.origins:
            return "the browser says another site sent this request (--allowed-origins)"
        return None

    def _origin_allowed(self, origin: str) -> bool:
        origin = origin.rstrip("/").lower()
        if "*" in self.origins or origin in self.origins:
            return True
        parts = urlsplit(origin)  # "null" (a sandboxed page, a file) has no host: refused
        return parts.scheme in ("http", "https") and (parts.hostname or "") in self.hosts
