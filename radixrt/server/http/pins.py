"""Pins made through the gateway (`/pin`): each HTTP caller's own, each held for a lease.

The gateway pins on its one ZeroMQ connection for every caller, so it keeps the books the
runtime keeps per connection: whose pin it is (ids are scoped by the caller's key, and the pin
goes with that key, so the runtime counts it under the caller's tenant), how many one caller
holds, and until when. A lease (`--http-pin-lease`) ends an HTTP caller's pin even if it never
calls `/unpin`: a pin only keeps a prefix cached, so its end changes no result.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from radixrt.protocol import ErrorCode
from radixrt.server.http.errors import APIError

logger = logging.getLogger(__name__)

MAX_PINS_PER_CALLER = 1024  # the gateway's own table stays bounded whatever the runtime allows
# an HTTP caller's own pin id; the runtime's bound (protocol.MAX_PIN_ID_CHARS) leaves room for the scope
MAX_CALLER_PIN_ID_CHARS = 256
SWEEP_S = 1.0  # how often expired leases are looked for


@dataclass(frozen=True)
class PinLease:
    """One caller's pin: its id on the runtime (the caller's scope, then its own id), the
    caller's key (sent with the unpin, as with the pin) and when it ends (time.monotonic())."""

    scope: str
    runtime_id: str
    api_key: str | None
    expires: float


def caller_scope(api_key: str | None) -> str:
    """A caller's namespace of pin ids: its key's digest (one key cannot name another's pins)."""
    return hashlib.sha256((api_key or "").encode()).hexdigest()[:16]


def runtime_pin_id(api_key: str | None, pin_id: str) -> str:
    """The id on the runtime of the caller's pin `pin_id`."""
    return f"{caller_scope(api_key)}/{pin_id}"


class PinLeases:
    """The pins HTTP callers hold through this gateway, by runtime id. Not thread-safe: the
    gateway's event loop is its one user."""

    def __init__(self, lease_s: float):
        self.lease_s = lease_s
        self.leases: dict[str, PinLease] = {}
        self.held: Counter[str] = Counter()  # scope -> leases

    def claim(self, api_key: str | None, pin_id: str) -> PinLease:
        """Reserve the caller's lease on `pin_id` before the pin is sent (`release` it if the
        pin fails): 400 for an id the caller holds already, 429 `rate_limited` past
        MAX_PINS_PER_CALLER."""
        expires = time.monotonic() + self.lease_s
        lease = PinLease(caller_scope(api_key), runtime_pin_id(api_key, pin_id), api_key, expires)
        scope = lease.scope
        if lease.runtime_id in self.leases:
            raise APIError(
                400,
                f"pin {pin_id!r} is held already; unpin it first",
                param="pin_id",
                code=ErrorCode.INVALID_REQUEST.value,
            )
        if self.held[scope] >= MAX_PINS_PER_CALLER:
            raise APIError(
                429,
                f"this caller holds {MAX_PINS_PER_CALLER} pins (the most); unpin some first",
                "rate_limit_error",
                code=ErrorCode.RATE_LIMITED.value,
                retry_after=1,
            )
        self.leases[lease.runtime_id] = lease
        self.held[scope] += 1
        return lease

    def release(self, runtime_id: str) -> PinLease | None:
        lease = self.leases.pop(runtime_id, None)
        if lease is not None:
            self.held[lease.scope] -= 1
            if not self.held[lease.scope]:
                del self.held[lease.scope]
        return lease

    def expired(self, now: float) -> list[PinLease]:
        """Release and return the leases that ended by `now`."""
        ended = [lease.runtime_id for lease in self.leases.values() if lease.expires <= now]
        return [lease for rid in ended if (lease := self.release(rid)) is not None]

    async def expire_forever(self, unpin: Callable[[PinLease], Awaitable[object]]) -> None:
        """Every SWEEP_S, unpin the pins whose lease ended; a failed unpin is logged (the
        runtime drops the pins of the gateway's connection when that goes)."""
        while True:
            await asyncio.sleep(SWEEP_S)
            for lease in self.expired(time.monotonic()):
                try:
                    await unpin(lease)
                except Exception as e:  # the runtime is gone or stalled: nothing to retry here
                    logger.warning("could not unpin %s at its lease's end: %s", lease.runtime_id, e)
