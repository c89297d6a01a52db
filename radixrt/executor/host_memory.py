"""The host heap around a model load (glibc only; elsewhere a no-op).

A load allocates and frees one float or block temporary per weight, megabytes each, between the
packed weights it keeps. glibc serves such sizes from its heap once its mmap threshold has risen
past them (the threshold is dynamic: each freed mapped chunk raises it, up to 32 MB), and a heap
only shrinks from its top, so what the temporaries held stays resident after the load: 400 MB of
a 1.1B GGUF load's 1.5 GB peak, measured. During a load, chunks of `LOAD_MMAP_THRESHOLD` and more
are therefore mapped, each returned to the OS when freed; afterwards the threshold is set to
`SERVE_MMAP_THRESHOLD` (the dynamic one's ceiling, where a long-running process ends anyway, so
the step's activations are served as before) and the heap is trimmed."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)
LOAD_MMAP_THRESHOLD = 1 << 20
SERVE_MMAP_THRESHOLD = 32 << 20


@cache
def _glibc() -> ctypes.CDLL | None:
    """glibc, where the process runs on it (it alone has `mallopt`'s threshold and
    `malloc_trim`)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "gnu_get_libc_version") else None


@contextmanager
def loading() -> Iterator[None]:
    """Around a load (on any device: the host holds its temporaries): temporaries mapped, the
    heap trimmed after. Process-wide, as glibc's settings are."""
    libc = _glibc()
    if libc is None:
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, LOAD_MMAP_THRESHOLD)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, SERVE_MMAP_THRESHOLD)
        libc.malloc_trim(0)
