"""What every listening process checks before it binds: the runtime, the router, a fleet."""

from __future__ import annotations

import logging

import zmq

from radixrt.config import is_loopback_host

logger = logging.getLogger(__name__)


def check_exposure(host: str, api_key: str | None, curve_secret_key: str | None) -> None:
    """Refuse a non-loopback bind without a key; log the CURVE public key clients need."""
    if not is_loopback_host(host) and not (api_key or curve_secret_key):
        raise SystemExit(f"refusing to listen on {host} without --api-key or --curve-secret-key")
    if curve_secret_key:
        logger.info(
            "CURVE on; clients need the server public key %s",
            zmq.curve_public(curve_secret_key.encode()).decode(),
        )
