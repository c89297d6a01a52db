"""A KV-slot ownership checker that lives in the tests, apart from the runtime's own checks.

It reads the plain-data `memory_snapshot` (from `Scheduler.memory_snapshot()` in-process or the
`memory_snapshot` op of a server) and asserts, with none of the runtime's code:
- every page of the pool is free, or held by exactly one tree node, or by exactly one running
  request's private range (`row[tree_len:kv_len]`, filled from the start of each page);
- a tree node holds whole pages; page 0 (padding) belongs to nobody;
- with a host tier, every host page is free or held by exactly one node's host copy, and a node
  on the device hangs under a node on the device;
- a request's tree part is exactly the slots of the tree path that ends at its locked node;
- every node's lock count equals the requests and pins whose locked node lies in its subtree;
- request-table rows are each used once, and used + free rows add up.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any


def _claim(owners: dict[int, str], page: int, who: str) -> None:
    assert page != 0, f"{who} holds the padding page"
    assert page not in owners, f"page {page} is held by {owners[page]} and by {who}"
    owners[page] = who


def _claim_pages(
    owners: dict[int, str], slots: list[int], page_size: int, who: str, whole: bool
) -> None:
    """Claim the pages of `slots`, which must fill each page from its first slot on, in order."""
    for start in range(0, len(slots), page_size):
        chunk = slots[start : start + page_size]
        page = chunk[0] // page_size
        assert chunk == list(range(page * page_size, page * page_size + len(chunk))), (
            f"{who} holds slots {chunk} that do not fill page {page} in order"
        )
        assert not whole or len(chunk) == page_size, f"{who} holds a partial page {page}"
        _claim(owners, page, who)


def _paths(snapshot: dict[str, Any]) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Each node's slots from the root down to it, and its ancestors (itself included)."""
    nodes = {n["id"]: n for n in snapshot["nodes"]}
    roots = snapshot.get("roots", [snapshot["root"]])  # one per cache salt
    slots_to: dict[int, list[int]] = {root: [] for root in roots}
    up: dict[int, list[int]] = {root: [] for root in roots}

    def resolve(node_id: int) -> None:
        if node_id in slots_to:
            return
        parent = nodes[node_id]["parent"]
        assert parent in nodes or parent in roots, f"node {node_id} hangs off a missing parent"
        resolve(parent)
        slots_to[node_id] = slots_to[parent] + nodes[node_id]["slots"]
        up[node_id] = [node_id, *up[parent]]

    for node_id in nodes:
        resolve(node_id)
    return slots_to, up


def assert_slot_ownership(snapshot: dict[str, Any]) -> None:
    p = snapshot["page_size"]
    owners: dict[int, str] = {}
    for page in snapshot["free_pages"]:
        _claim(owners, page, "the free list")
    by_id = {node["id"]: node for node in snapshot["nodes"]}
    host_owners: dict[int, str] = {}
    for page in snapshot.get("host_free_pages", []):
        _claim(host_owners, page, "the host free list")
    for node in snapshot["nodes"]:
        who = f"tree node {node['id']}"
        assert node["slots"] or node["host_slots"], f"{who} is held nowhere"
        if node["slots"]:
            parent = by_id.get(node["parent"])
            assert parent is None or parent["slots"], f"{who} is on the device, its parent not"
            _claim_pages(owners, node["slots"], p, who, whole=True)
        if node["host_slots"]:
            assert "host_num_pages" in snapshot, f"{who} is on a host tier that does not exist"
            _claim_pages(host_owners, node["host_slots"], p, f"host copy of {who}", whole=True)
    for req in snapshot["requests"]:
        _claim_pages(owners, req["own_slots"], p, f"request {req['rid']}", whole=False)
    missing = set(range(1, snapshot["num_pages"] + 1)) - set(owners)
    assert not missing, f"pages held by nobody (leaked): {sorted(missing)[:10]}"
    assert len(owners) == snapshot["num_pages"], "a page outside the pool is held"
    if "host_num_pages" in snapshot:
        assert set(host_owners) == set(range(1, snapshot["host_num_pages"] + 1)), (
            "host pages leaked, or held outside the host pool"
        )

    slots_to, up = _paths(snapshot)
    locks: Counter = Counter()
    for req in snapshot["requests"]:
        assert req["last_node"] in slots_to, f"request {req['rid']} locks a node not in the tree"
        assert req["tree_slots"] == slots_to[req["last_node"]], (
            f"request {req['rid']} reads slots that are not the tree's copy of its prefix"
        )
        locks.update(up[req["last_node"]])
    for node_id in snapshot["pinned_nodes"]:
        assert node_id in slots_to, "a pin locks a node not in the tree"
        locks.update(up[node_id])
    for node in snapshot["nodes"]:
        assert node["lock_ref"] == locks[node["id"]], (
            f"node {node['id']} counts {node['lock_ref']} locks, {locks[node['id']]} are held"
        )

    rows = snapshot["running_rows"]
    assert len(set(rows)) == len(rows), "two running requests share a request-table row"
    assert len(rows) + snapshot["free_rows"] == snapshot["rows"], "request-table rows leaked"


def assert_all_free(snapshot: dict[str, Any]) -> None:
    """Nothing runs, nothing is cached or pinned: every page and row is free."""
    assert_slot_ownership(snapshot)
    assert not snapshot["nodes"] and not snapshot["requests"] and not snapshot["pinned_nodes"]
    assert len(snapshot["free_pages"]) == snapshot["num_pages"]
    assert len(snapshot.get("host_free_pages", [])) == snapshot.get("host_num_pages", 0)


def wait_idle(endpoint, timeout: float = 30.0) -> dict:
    """The runtime's stats once nothing runs or waits (an AssertionError after `timeout`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = endpoint.stats()
        if stats["running"] == stats["waiting"] == 0:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"requests still running after {timeout}s: {stats}")


def check_scheduler(scheduler) -> None:
    """The scheduler's own invariant checks, then this checker's, on an in-process Scheduler."""
    scheduler.check_invariants()
    assert_slot_ownership(scheduler.memory_snapshot())


def assert_no_leak(endpoint) -> None:
    """Invariant 2: idle, consistent, and fully free once flushed. `endpoint` is a runtime (its
    ops; waits until it is idle) or an in-process Scheduler (which must have no work left: it
    only moves when stepped)."""
    if hasattr(endpoint, "has_work"):
        assert not endpoint.has_work(), "the scheduler still has work"
    else:
        wait_idle(endpoint)
    endpoint.check_invariants()
    assert_slot_ownership(endpoint.memory_snapshot())
    assert endpoint.flush_cache()
    assert_all_free(endpoint.memory_snapshot())
    stats = endpoint.stats()
    assert stats["free_tokens"] == stats["total_tokens"]
