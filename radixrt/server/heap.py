"""The C heap of a long-running runtime, kept from creeping up.

A forward allocates activations whose sizes follow the batch: a different size nearly every
step. glibc raises its mmap threshold each time it frees a mapped block (up to 32 MiB), so
later blocks of a few MiB come from the heap's arenas, where freed space fragments: a loop of
prepacked linears over every row count from 1 to 700 grew a process from 0.3 to 2-4 GiB this
way (docs/reliability.md). A fixed threshold (`MMAP_THRESHOLD`) turns that adjustment off, so
every block that large is mapped and unmapped whole (at the price of a page fault per 4 KiB
of it); and `malloc_trim(0)`, every `TRIM_EVERY_S` from the serving loop, hands
the free pages inside the arenas back to the kernel (it takes milliseconds). Both are no-ops
where libc is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt's parameter number, from glibc's malloc.h
MMAP_THRESHOLD = 2 << 20
TRIM_EVERY_S = 30.0


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


class Heap:
    """Fixes the mmap threshold when made; `tick()` from the serving loop trims the heap every
    `TRIM_EVERY_S` seconds."""

    def __init__(self) -> None:
        self.libc = _glibc()
        self.next_trim = time.monotonic() + TRIM_EVERY_S
        self.trims = 0
        if self.libc is not None and not self.libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD):
            logger.warning("mallopt(M_MMAP_THRESHOLD) failed: the heap may creep up")

    def tick(self) -> None:
        now = time.monotonic()
        if self.libc is not None and now >= self.next_trim:
            self.next_trim = now + TRIM_EVERY_S
            self.libc.malloc_trim(0)
            self.trims += 1
