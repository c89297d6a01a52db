"""The C heap of a long-running runtime, handed back to the kernel now and then.

A forward allocates activations whose sizes follow the batch, a different size nearly every
step, and freed space inside glibc's arenas stays in the process's RSS. `malloc_trim(0)` returns
the free pages; the serving loop calls `tick()`, which does that every `TRIM_EVERY_S` (it takes
milliseconds; in the soak each trim gave back 50-80 MiB). It does not stop the soak's slow RSS
growth, which docs/reliability.md describes. A no-op where libc is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable

TRIM_EVERY_S = 30.0


def _glibc_trim() -> Callable[[int], int] | None:
    try:
        trim: Callable[[int], int] = ctypes.CDLL(
            ctypes.util.find_library("c") or "libc.so.6"
        ).malloc_trim
        return trim
    except (OSError, AttributeError):
        return None


class Heap:
    """`tick()` from the serving loop: trims the heap every `TRIM_EVERY_S` seconds."""

    def __init__(self) -> None:
        self.trim = _glibc_trim()
        self.next_trim = time.monotonic() + TRIM_EVERY_S
        self.trims = 0

    def tick(self) -> None:
        now = time.monotonic()
        if self.trim is not None and now >= self.next_trim:
            self.next_trim = now + TRIM_EVERY_S
            self.trim(0)
            self.trims += 1
