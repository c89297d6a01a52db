"""Logging a sender cannot flood: `LogThrottle` (the runtime's and the router's client fronts,
the KV-event publisher's replay socket)."""

from __future__ import annotations

import logging
import time

LOG_EVERY_S = 10.0
MAX_TEXTS = 4096  # texts remembered; past that all are forgotten (each may log once more)


class LogThrottle:
    """Warnings a sender can cause, logged at most once per LOG_EVERY_S each (by text), with a
    count of how many were held back, so a flood cannot flood the log."""

    def __init__(self, log: logging.Logger):
        self.log = log
        self.last: dict[str, float] = {}  # when each text was last logged
        self.held: dict[str, int] = {}  # how many of each were held back since

    def note(self, what: str) -> None:
        now = time.monotonic()
        if now - self.last.get(what, -LOG_EVERY_S) < LOG_EVERY_S:
            self.held[what] = self.held.get(what, 0) + 1
            return
        if len(self.last) > MAX_TEXTS:
            self.last.clear()
            self.held.clear()
        self.last[what] = now
        self.log.warning("%s (%d like it held back)", what, self.held.pop(what, 0))
