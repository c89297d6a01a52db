"""Finite waits for every endpoint a test uses, so a liveness bug fails instead of hanging."""

REPLY_TIMEOUT_S = 120.0  # one reply from a runtime on this 2-core machine, with room to spare
