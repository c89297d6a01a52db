"""Per-tenant counters for `stats()["tenants"]` and the gateway's /metrics."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from radixrt.engine.request import Req
from radixrt.protocol import tenant_label


@dataclass
class TenantCounters:
    """One tenant's totals since start; `rate_limited` is counted by the server."""

    requests: int = 0  # accepted into the queue
    prompt_tokens: int = 0  # of admitted requests
    cached_prompt_tokens: int = 0  # of which served from this tenant's own cache
    timeouts: int = 0
    rate_limited: int = 0

    def admitted(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.cached_prompt_tokens += cached_tokens


class TenantStats:
    """Counters by tenant name, made on first use."""

    def __init__(self) -> None:
        self.by_tenant: dict[str, TenantCounters] = {}

    def of(self, tenant: str) -> TenantCounters:
        return self.by_tenant.setdefault(tenant, TenantCounters())

    def snapshot(self, waiting: Iterable[Req], running: Iterable[Req]) -> dict[str, Any]:
        """label -> counters plus the tenant's `waiting` and `running` requests now."""
        out = {
            tenant_label(t): {**asdict(c), "waiting": 0, "running": 0}
            for t, c in self.by_tenant.items()
        }
        for key, reqs in (("waiting", waiting), ("running", running)):
            for req in reqs:
                out[tenant_label(req.scope.tenant)][key] += 1
        return out
