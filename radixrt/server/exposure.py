"""What every listening process checks before it binds: the runtime, the router, a fleet."""

from __future__ import annotations

import logging

import zmq

from radixrt.config import KVEventsConfig, is_loopback_host

logger = logging.getLogger(__name__)

# How long closing a socket waits for the frames still queued on it: a final reply or error
# sent just before a process stops reaches its client instead of being dropped.
CLOSE_LINGER_MS = 1000


def check_exposure(
    host: str,
    keyed: bool,
    curve_secret_key: str | None,
    curve_client_keys: str | None = None,
) -> None:
    """Refuse a non-loopback bind that neither an API key (`keyed`) nor a CURVE client
    allowlist guards (CURVE alone encrypts but lets any key pair in); log the CURVE public key
    clients need."""
    if not is_loopback_host(host) and not (keyed or curve_client_keys):
        raise SystemExit(
            f"refusing to listen on {host} without --api-key, --api-key-file, --admin-api-key "
            "or --curve-client-keys"
        )
    if curve_secret_key:
        logger.info(
            "CURVE on; clients need the server public key %s",
            zmq.curve_public(curve_secret_key.encode()).decode(),
        )


def check_kv_events_exposure(events: KVEventsConfig | None, keyed: bool) -> None:
    """Refuse KV-event sockets bound beyond loopback (`KVEventsConfig.exposed_endpoints`) on a
    server without keys, unless the config says `allow_non_loopback`: the events name the pages
    every tenant caches, and the PUB and replay sockets check no key."""
    if events is None or not events.enabled or events.allow_non_loopback or keyed:
        return
    exposed = events.exposed_endpoints()
    if exposed:
        raise SystemExit(
            f"refusing to publish KV events on {', '.join(exposed)} without --api-key, "
            '--api-key-file or --admin-api-key, or "allow_non_loopback": true in '
            "--kv-events-config"
        )


def bind_client_socket(
    ctx: zmq.Context[zmq.Socket[bytes]],
    endpoint: str,
    curve_secret_key: str | None,
    max_frame_bytes: int = -1,
) -> zmq.Socket[bytes]:
    """The ROUTER socket clients connect to (a runtime's or a router's): `CLOSE_LINGER_MS` of
    linger, CURVE when a secret key is set, frames above `max_frame_bytes` refused by ZeroMQ
    itself (it drops the sender's connection before allocating the frame), sends to a peer no
    longer connected raising EHOSTUNREACH (ClientFront.vanished), bound to `endpoint`."""
    sock: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a vanished peer fails, and says so
    if curve_secret_key:
        sock.curve_secretkey = curve_secret_key.encode()
        sock.curve_server = True
    sock.bind(endpoint)
    return sock
