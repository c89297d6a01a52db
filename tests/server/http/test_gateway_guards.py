"""The gateway's guards as components, without a model: which browsers' requests a keyless
server answers (`SitePolicy`), and the CPU pool's bounds and fairness (`CpuPool`, with real
threads and real waits)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from radixrt.server.http.cpu_pool import (
    CALLER,
    MAX_WAITING_PER_TENANT,
    SMALL_JOB_BYTES,
    Caller,
    CpuPool,
)
from radixrt.server.http.errors import APIError
from radixrt.server.http.origins import SitePolicy, host_name

LOCAL = SitePolicy.of("127.0.0.1", (), ())


def _headers(**values: str) -> dict[bytes, bytes]:
    return {k.replace("_", "-").encode(): v.encode() for k, v in values.items()}


@pytest.mark.parametrize(
    "authority, name",
    [
        ("localhost:30000", "localhost"),
        ("[::1]:8", "::1"),
        ("127.0.0.1", "127.0.0.1"),
        ("::1", "::1"),
    ],
)
def test_host_names(authority, name):
    assert host_name(authority) == name


def test_a_loopback_server_answers_its_own_names_and_no_other_site():
    assert LOCAL.refusal(_headers(host="localhost:30000")) is None
    assert LOCAL.refusal(_headers(host="[::1]:30000", origin="http://127.0.0.1:8080")) is None
    assert LOCAL.refusal(_headers(host="127.0.0.1:30000", sec_fetch_site="same-origin")) is None
    assert LOCAL.refusal({}) is None  # no Host at all: not a browser
    assert "Host" in LOCAL.refusal(_headers(host="rebound.example:30000"))
    assert "Origin" in LOCAL.refusal(_headers(host="localhost", origin="https://evil.example"))
    assert "Origin" in LOCAL.refusal(_headers(host="localhost", origin="null"))
    assert "another site" in LOCAL.refusal(_headers(host="localhost", sec_fetch_site="cross-site"))


def test_the_operator_widens_the_sets():
    policy = SitePolicy.of("127.0.0.1", ("gpu-box",), ("https://notebook.example/",))
    assert policy.refusal(_headers(host="gpu-box:30000")) is None
    assert policy.refusal(_headers(host="gpu-box", origin="https://notebook.example")) is None
    assert policy.refusal(_headers(host="gpu-box", origin="https://other.example")) is not None
    anyone = SitePolicy.of("127.0.0.1", ("*",), ("*",))
    assert (
        anyone.refusal(_headers(host="x", origin="https://y", sec_fetch_site="cross-site")) is None
    )


def _heavy(tenant: str) -> None:
    CALLER.set(Caller(tenant, SMALL_JOB_BYTES + 1))


def test_small_jobs_find_a_thread_while_heavy_ones_hold_the_rest():
    """With 3 threads, heavy jobs of two tenants hold at most 2; a small job runs at once."""

    async def main() -> float:
        pool = CpuPool(3)
        release = threading.Event()

        async def heavy(tenant: str) -> None:
            _heavy(tenant)
            await pool.run(release.wait, 10)

        tasks = [asyncio.create_task(heavy(t)) for t in ("a", "b", "a", "b")]
        await asyncio.sleep(0.2)
        CALLER.set(Caller("a", 10))
        start = time.perf_counter()
        assert await pool.run(lambda: 42) == 42
        waited = time.perf_counter() - start
        release.set()
        await asyncio.gather(*tasks)
        pool.close()
        return waited

    assert asyncio.run(main()) < 1.0


def test_one_tenant_cannot_take_every_turn():
    """Tenant a queues many heavy jobs first; tenant b's one runs before a's queue drains."""

    async def main() -> list[str]:
        pool = CpuPool(3)  # one heavy turn per tenant, two shared
        order: list[str] = []

        def job(name: str) -> None:
            time.sleep(0.05)
            order.append(name)

        async def heavy(tenant: str, name: str) -> None:
            _heavy(tenant)
            await pool.run(job, name)

        tasks = [asyncio.create_task(heavy("a", f"a{i}")) for i in range(6)]
        await asyncio.sleep(0.01)
        tasks.append(asyncio.create_task(heavy("b", "b0")))
        await asyncio.gather(*tasks)
        pool.close()
        return order

    order = asyncio.run(main())
    assert order.index("b0") <= 2, order


def test_a_tenant_with_too_many_heavy_jobs_waiting_is_rate_limited():
    async def main() -> list[object]:
        pool = CpuPool(2)
        release = threading.Event()

        async def heavy() -> None:
            _heavy("a")
            await pool.run(release.wait, 10)

        tasks = [asyncio.create_task(heavy()) for _ in range(MAX_WAITING_PER_TENANT + 3)]
        await asyncio.sleep(0.2)
        release.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        pool.close()
        return results

    results = asyncio.run(main())
    refused = [r for r in results if isinstance(r, APIError)]
    assert refused and all(r.status == 429 and r.code == "rate_limited" for r in refused)
    assert len(results) - len(refused) == MAX_WAITING_PER_TENANT + 1  # one ran, the rest waited
