"""`radixrt router`: its flags and its process."""

from __future__ import annotations

import argparse
import logging
import os
import signal
from typing import Any

from radixrt.config import SECRETS
from radixrt.server.exposure import check_exposure
from radixrt.server.router.policy import POLICIES, CacheAwareThresholds
from radixrt.server.router.router import Router, RouterConfig

logger = logging.getLogger(__name__)


def add_router_args(parser: argparse.ArgumentParser) -> None:
    d = CacheAwareThresholds()
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    parser.add_argument("--port", type=int, default=30000, help="the clients' port")
    parser.add_argument(
        "--worker",
        action="append",
        required=True,
        help="a worker's address, e.g. tcp://10.0.0.2:30000 (repeat for each)",
    )
    parser.add_argument("--policy", default="cache-aware", choices=POLICIES)
    parser.add_argument(
        "--cache-threshold",
        type=float,
        default=d.cache_threshold,
        help=f"cache-aware: route by match when it covers this share of the prompt (default: {d.cache_threshold})",
    )
    parser.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=d.balance_abs_threshold,
        help=f"cache-aware: out of balance when the busiest worker has this many more sequences (default: {d.balance_abs_threshold})...",
    )
    parser.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=d.balance_rel_threshold,
        help=f"...and this many times as many as the idlest (default: {d.balance_rel_threshold})",
    )
    parser.add_argument("--api-key", help=f"clients must send it (or set {SECRETS['api_key']})")
    parser.add_argument(
        "--worker-api-key", help="what the router sends the workers (default: --api-key)"
    )
    parser.add_argument(
        "--curve-secret-key",
        help=f"Z85 CURVE secret key of the clients' socket (or set {SECRETS['curve_secret_key']})",
    )
    parser.add_argument("--worker-curve-server-key", help="the workers' CURVE public key")
    parser.add_argument(
        "--tokenizer",
        help="the workers' tokenizer.json, when their model folder is not on this machine",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=RouterConfig.drain_timeout,
        help="on SIGTERM: refuse new generates ('draining'), let those in flight finish for at most this many seconds, end the rest with 'draining', exit 0",
    )
    parser.add_argument("--log-level", default="info")


def run_router(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s %(name)s] %(message)s")
    api_key = args.api_key or os.environ.get(SECRETS["api_key"]) or None
    curve = args.curve_secret_key or os.environ.get(SECRETS["curve_secret_key"]) or None
    check_exposure(args.host, api_key, curve)
    config = RouterConfig(
        workers=tuple(args.worker),
        policy=args.policy,
        thresholds=CacheAwareThresholds(
            args.cache_threshold, args.balance_abs_threshold, args.balance_rel_threshold
        ),
        api_key=api_key,
        worker_api_key=args.worker_api_key or api_key,
        curve_secret_key=curve,
        worker_curve_server_key=args.worker_curve_server_key,
        tokenizer=args.tokenizer,
        drain_timeout=args.drain_timeout,
    )
    endpoint = args.host if args.host.startswith("ipc://") else f"tcp://{args.host}:{args.port}"
    router = Router(config, endpoint)

    def stop(*_: Any) -> None:
        router.running = False

    signal.signal(signal.SIGTERM, lambda *_: router.begin_drain())
    signal.signal(signal.SIGINT, stop)
    logger.info("routing %d workers on %s (%s)", len(config.workers), endpoint, config.policy)
    router.serve_forever()
