"""The tests' runtimes by their settings: one factory (`RuntimeFactory`, the `runtimes` fixture),
so that tests and modules whose settings match share a process instead of each starting one
(a start costs a process, seconds of imports and a model load; a `dp_size` fleet, several).

A shared runtime's contract: a test may send it anything a client may, but must leave it serving
as it found it (no shutdown, no pins, tenants or adapters left behind, no assertion on a cold
cache or on counters it did not read first). A test that stops, kills or wedges its runtime,
changes its weights, or needs two processes with the same settings starts its own with
`helpers.launch_runtime`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import radixrt as rt

from helpers import launch_runtime

# Idle runtimes (no lease holds them) the factory keeps for a later lease with the same
# settings, the least recently released stopped first. Only the tiny model's are kept: a real
# model's runtime holds gigabytes, and two xdist workers share this machine's memory.
KEEP_IDLE = 3


@dataclass(frozen=True)
class Settings:
    """What makes two runtimes interchangeable: the model and `launch_runtime`'s arguments."""

    model: str
    http: bool
    overrides: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, model: str | Path, http: bool, overrides: dict[str, Any]) -> Settings:
        return cls(str(model), http, tuple(sorted(overrides.items())))


@dataclass
class _Live:
    runtime: rt.Runtime
    leases: int = 0


@dataclass
class RuntimeFactory:
    """Runtimes started at the first lease of their settings and shared by every lease with the
    same settings while one is alive. `keep_idle_for` names the model folder whose idle
    runtimes are kept (at most KEEP_IDLE); any other model's stops when its last lease ends.
    `close` stops them all (the session's end)."""

    keep_idle_for: Path
    _live: dict[Settings, _Live] = field(default_factory=dict)
    _idle: list[Settings] = field(default_factory=list)  # least recently released first
    starts: int = 0

    @contextmanager
    def lease(
        self, model: str | Path, *, http: bool = False, **overrides: Any
    ) -> Iterator[rt.Runtime]:
        """The runtime with these settings (`launch_runtime`'s arguments), started if none is
        alive, held for the `with` block."""
        key = Settings.of(model, http, overrides)
        if key in self._idle:
            self._idle.remove(key)
            if self._live[key].runtime._proc.poll() is not None:  # it died idle: start anew
                self._stop(key)
        live = self._live.get(key)
        if live is None:
            live = self._live[key] = _Live(launch_runtime(model, http=http, **overrides))
            self.starts += 1
        live.leases += 1
        try:
            yield live.runtime
        finally:
            live.leases -= 1
            if live.leases == 0:
                self._release(key)

    def _release(self, key: Settings) -> None:
        """`key`'s runtime has no lease left: kept idle (the tiny model's) or stopped, and the
        idle ones past KEEP_IDLE stopped, oldest first."""
        if Path(key.model) == self.keep_idle_for:
            self._idle.append(key)
        else:
            self._stop(key)
        while len(self._idle) > KEEP_IDLE:
            self._stop(self._idle.pop(0))

    def _stop(self, key: Settings) -> None:
        self._live.pop(key).runtime.shutdown()

    def close(self) -> None:
        """Stop every runtime (the session is over; no lease may be held)."""
        held = [k for k, live in self._live.items() if live.leases]
        assert not held, f"runtimes still leased at the session's end: {held}"
        for key in list(self._live):
            self._stop(key)
        self._idle.clear()
