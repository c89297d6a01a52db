"""`radixrt router`: its process (its flags are `radixrt.config.RouterArgs`)."""

from __future__ import annotations

import logging
import signal
from dataclasses import replace
from typing import Any

from radixrt.config import RouterArgs, RouterSettings, WorkerSettings
from radixrt.server.front import FrontConfig
from radixrt.server.router.metrics_http import serve_metrics
from radixrt.server.router.router import Router, RouterConfig
from radixrt.server.tenants import KeyRing

logger = logging.getLogger(__name__)


def router_config(args: RouterArgs) -> RouterConfig:
    """What the router runs with: `args`, the workers' key defaulting to one the clients use."""
    front = FrontConfig.of(args)
    worker_api_key = (
        args.worker_api_key
        or KeyRing.from_settings(front.api_key, front.api_key_file, front.admin_api_key).any_key()
    )
    fleet = replace(WorkerSettings.of(args), worker_api_key=worker_api_key)
    return RouterConfig(fleet=fleet, routing=RouterSettings.of(args), front=front)


def run_router(args: RouterArgs) -> None:
    """Route until SIGINT; SIGTERM drains first. `args` has its secrets already (from the
    environment where not given)."""
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s %(name)s] %(message)s")
    config = router_config(args)
    config.front.check_exposure(args.host)
    router = Router(config, args.endpoint)

    def stop(*_: Any) -> None:
        router.running = False

    signal.signal(signal.SIGTERM, lambda *_: router.begin_drain())
    signal.signal(signal.SIGINT, stop)
    logger.info(
        "routing %d workers on %s (%s)", len(config.fleet.worker), args.endpoint, args.router_policy
    )
    metrics = None
    if args.metrics_port is not None:
        keys = KeyRing.from_settings(args.api_key, args.api_key_file, args.admin_api_key)
        host = "127.0.0.1" if args.host.startswith("ipc://") else args.host
        metrics = serve_metrics(host, args.metrics_port, args.endpoint, keys)
        logger.info("metrics on http://%s:%d/metrics", host, args.metrics_port)
    try:
        router.serve_forever()
    finally:
        if metrics is not None:
            metrics.shutdown()
