"""Processes radixrt starts: none outlives the process that started it, and none takes the
working directory's modules (`python_command`).

A launcher (`rt.Runtime`, `rt.Engine`, a `--dp-size` fleet for its workers) puts its pid in
RADIXRT_PARENT_PID; the child then ends itself once that process is no longer its parent, so a
parent killed with no chance to clean up (SIGKILL, a crash) leaves no runtime behind. A server
started by hand has no such variable and is never watched.
"""

from __future__ import annotations

import os
import sys
import threading
import time

PARENT_PID_ENV = "RADIXRT_PARENT_PID"
SAFE_PATH = ["-P"] if sys.version_info >= (3, 11) else []
WATCH_PERIOD_S = 1.0


def exit_with_parent(parent_pid: int | None = None) -> None:
    """Watch `parent_pid` (default: $RADIXRT_PARENT_PID) from a daemon thread and `os._exit(1)`
    when it is gone. The exit is immediate: a process of ours that watches this one in turn
    (a tensor-parallel rank, a fleet's worker) follows within a period."""
    if parent_pid is None:
        parent_pid = int(os.environ.get(PARENT_PID_ENV) or 0) or None
    if parent_pid is None:
        return

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCH_PERIOD_S)
        os._exit(1)

    threading.Thread(target=watch, name="radixrt-parent-watch", daemon=True).start()


def python_command(*args: str) -> list[str]:
    """This interpreter running `args` (e.g. `-m radixrt serve ...`) without the working directory
    on sys.path (`-P`, Python 3.11+): started in a checkout, its top-level kernels/ would take the
    import name of Hugging Face's `kernels`, which transformers imports."""
    return [sys.executable, *SAFE_PATH, *args]
