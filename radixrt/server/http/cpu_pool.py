"""`CpuPool`: the gateway's CPU-heavy steps (tokenizing, detokenizing, echoes, chat templates,
tool schemas, count_tokens) off its event loop, on threads of their own, bounded and fair.

On the event loop, one 15 MiB `/tokenize` held every other caller (`/health` included) for
seconds; on asyncio's default executor, a few large `count_tokens` took every thread the
gateway also waits on the runtime with. Here a job runs on the pool's own threads (Hugging Face
fast tokenizers run in Rust and release the GIL; a template renders in Python, which yields the
GIL every few milliseconds), so the loop keeps answering.

A job is *heavy* when its input is over SMALL_JOB_BYTES. Heavy jobs hold at most `threads - 1`
threads together, so a small one (an ordinary chat's template) always finds a thread, and one
tenant at most `max(1, (threads - 1) // 2)` of them, so one tenant's burst cannot take them
all from another: a tenant's job waits for one of its own turns before it waits for a shared
one, so the shared turns go round the tenants, not to whoever queued most first. A tenant with
MAX_WAITING_PER_TENANT heavy jobs waiting gets 'rate_limited'; past MAX_WAITING in all,
everyone's next heavy job gets 'overloaded'.
"""

from __future__ import annotations

import asyncio
import functools
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

from radixrt.protocol import ErrorCode
from radixrt.server.http.errors import RETRY_AFTER_S, APIError

T = TypeVar("T")
P = ParamSpec("P")

SMALL_JOB_BYTES = 64 << 10  # an input up to this is tokenized or rendered in milliseconds
MAX_WAITING_PER_TENANT = 8
MAX_WAITING = 64


@dataclass(frozen=True)
class Caller:
    """Whose HTTP request the current task serves: its tenant (its key's, "" without keys) and
    its body's size, the measure of the work its steps do. The gateway's guard sets it."""

    tenant: str = ""
    body_bytes: int = 0


CALLER: ContextVar[Caller] = ContextVar("gateway_caller", default=Caller())  # noqa: B039 (frozen)


def overloaded(message: str) -> APIError:
    """503 'overloaded', with its Retry-After."""
    code = ErrorCode.OVERLOADED
    return APIError(
        503, message, "overloaded_error", code=code.value, retry_after=RETRY_AFTER_S[code]
    )


@dataclass
class WaitingLine:
    """Jobs (`what`) waiting for a turn, counted per tenant: a tenant with `per_tenant` of them
    waiting gets 'rate_limited', and past `total` in all everyone's next gets 'overloaded'.
    Its one user is the event loop."""

    what: str
    per_tenant: int
    total: int
    counts: Counter[str] = field(default_factory=Counter)

    def join(self, tenant: str) -> None:
        if self.counts[tenant] >= self.per_tenant:
            code = ErrorCode.RATE_LIMITED
            message = f"{self.per_tenant} {self.what} of yours are waiting"
            raise APIError(429, message, "rate_limit_error", code=code.value, retry_after=1)
        if sum(self.counts.values()) >= self.total:
            raise overloaded(f"{self.total} {self.what} are waiting")
        self.counts[tenant] += 1

    def leave(self, tenant: str) -> None:
        self.counts[tenant] -= 1
        if not self.counts[tenant]:
            del self.counts[tenant]


class CpuPool:
    """Threads for the gateway's CPU-heavy steps (see the module docstring). Its semaphores are
    made on first use, inside the event loop that then is their one user."""

    def __init__(self, threads: int):
        """`threads`: 2 at least (`HttpSettings.check`), one of them kept for small jobs."""
        self.threads = threads
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="gateway-cpu")
        self.waiting = WaitingLine(
            "large tokenize/template jobs", MAX_WAITING_PER_TENANT, MAX_WAITING
        )  # heavy jobs not yet running
        self._shared: asyncio.Semaphore | None = None
        # tenant -> its turns; tenants are the key file's (a wrong key never gets this far)
        self._own: dict[str, asyncio.Semaphore] = {}

    @property
    def per_tenant(self) -> int:
        return max(1, (self.threads - 1) // 2)

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` on a pool thread, for the current `CALLER` (heavy when its body
        is over SMALL_JOB_BYTES). Raises what `fn` raises; 429/503 when too many heavy jobs
        wait."""
        call = functools.partial(fn, *args, **kwargs)
        loop = asyncio.get_running_loop()
        tenant, size = CALLER.get().tenant, CALLER.get().body_bytes
        if size <= SMALL_JOB_BYTES:
            return await loop.run_in_executor(self.executor, call)
        self.waiting.join(tenant)
        own = self._own.setdefault(tenant, asyncio.Semaphore(self.per_tenant))
        self._shared = shared = self._shared or asyncio.Semaphore(self.threads - 1)
        started = False
        try:
            async with own, shared:
                self.waiting.leave(tenant)
                started = True
                return await loop.run_in_executor(self.executor, call)
        finally:
            if not started:
                self.waiting.leave(tenant)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
