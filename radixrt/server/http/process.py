"""The gateway's process: a `radixrt http-gateway` child of `serve` (`server.launch`), serving the
port it inherits until SIGTERM or until its parent, the runtime, is gone."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import uvicorn

from radixrt.client.endpoint import ZmqEndpoint
from radixrt.config import GatewaySettings
from radixrt.server.http.app import build_app
from radixrt.server.http.gateway import REPLY_GRACE_S, Gateway
from radixrt.server.tenants import KeyRing

logger = logging.getLogger(__name__)


PARENT_POLL_S = 1.0


def run_gateway(
    url: str,
    fd: int,
    parent_pid: int | None = None,
    api_key: str | None = None,
    curve_server_key: str | None = None,
    log_level: str = "info",
    tool_call_parser: str = "auto",
    api_key_file: str | None = None,
    admin_api_key: str | None = None,
    limits: GatewaySettings | None = None,
    reasoning_parser: str | None = None,
) -> None:
    """Serve HTTP on the inherited listening socket `fd` until SIGTERM/SIGINT or the parent exits.
    Each request goes to the runtime with its client's own key (its tenant); the gateway's own
    calls (stats, health, `model_info` with the tokenizer's path) use the admin key (`serve`
    gives it one: `KeySettings.with_own_admin_key`), else `api_key`, else the first key of the
    file.
    `limits` (default: serve's defaults): no frame past the runtime's limit is sent, and no
    reply is waited for longer than the request timeout and a grace."""
    logging.basicConfig(level=log_level.upper(), format="[%(asctime)s %(name)s] %(message)s")
    limits = limits or GatewaySettings()
    keys = KeyRing.from_settings(api_key, api_key_file, admin_api_key)
    endpoint = ZmqEndpoint(
        url,
        api_key=keys.any_key(),
        curve_server_key=curve_server_key,
        timeout=limits.http_request_timeout + REPLY_GRACE_S,
        max_frame_bytes=limits.max_frame_bytes,
    )
    config = uvicorn.Config(
        build_app(Gateway(endpoint, keys, tool_call_parser, limits, reasoning_parser)),
        # uvicorn's own start/stop lines and access log only under debug: the runtime says
        # "HTTP on ..." once the model has loaded, and a bad setting stays one line
        log_level=log_level if log_level == "debug" else "warning",
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)

    def watch_parent() -> None:
        while not server.should_exit:
            if parent_pid is not None and os.getppid() != parent_pid:
                logger.warning("the runtime process is gone; stopping the HTTP gateway")
                # open streams end with an error event rather than just stopping
                endpoint.client.fail_pending("the runtime process is gone")
                server.should_exit = True
            time.sleep(PARENT_POLL_S)

    threading.Thread(target=watch_parent, daemon=True).start()
    try:
        server.run(sockets=[socket.socket(fileno=fd)])
    finally:
        endpoint.close()
