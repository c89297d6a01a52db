"""A fleet's `stats`: the workers' numbers summed, ratios recomputed from the sums, each tenant's
rows summed, and the router's own counters beside them. Pure functions of what the workers last
reported, so they are testable without a worker."""

from __future__ import annotations

from typing import Any


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def count(stats: dict[str, Any], name: str) -> int:
    """An int field of a worker's stats; 0 when it is missing or not an int."""
    value = stats.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def sum_numbers(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The numeric fields of `rows`, summed by name (other fields are left out)."""
    total: dict[str, Any] = {}
    for row in rows:
        for k, v in row.items():
            if is_number(v):
                total[k] = total.get(k, 0) + v
    return total


def sum_tenants(stats: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each tenant's counters summed over the workers' `tenants` rows."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for worker_stats in stats:
        for tenant, row in (worker_stats.get("tenants") or {}).items():
            rows.setdefault(tenant, []).append(row)
    return {tenant: sum_numbers(r) for tenant, r in rows.items()}


def fleet_stats(alive: list[dict[str, Any]]) -> dict[str, Any]:
    """The sums over the stats of the workers in rotation, with `cache_hit_rate`,
    `spec_accept_length` and `tp_size` recomputed (a ratio of sums, not a sum of ratios), and
    the per-tenant rows summed."""
    total = sum_numbers(alive)
    total["cache_hit_rate"] = total.get("cached_prompt_tokens_total", 0) / max(
        total.get("prompt_tokens_total", 0), 1
    )
    total["spec_accept_length"] = 1 + total.get("spec_accepted_tokens", 0) / max(
        total.get("spec_verifications", 0), 1
    )
    if alive:
        total["tp_size"] = alive[0].get("tp_size", 1)
    total["tenants"] = sum_tenants(alive)
    return total
