"""`radixrt router`: its flags and its process."""

from __future__ import annotations

import argparse
import logging
import os
import signal
from typing import Any

from radixrt.config import SECRETS, ServerArgs
from radixrt.server.front import FrontConfig
from radixrt.server.router.policy import POLICIES, CacheAwareThresholds
from radixrt.server.router.router import Router, RouterConfig
from radixrt.server.tenants import KeyRing

logger = logging.getLogger(__name__)


def add_router_args(parser: argparse.ArgumentParser) -> None:
    d = CacheAwareThresholds()
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    parser.add_argument(
        "--port",
        type=int,
        default=30001,
        help="the clients' ZeroMQ port (the router serves no HTTP)",
    )
    parser.add_argument(
        "--worker",
        action="append",
        required=True,
        help="a worker's address, e.g. tcp://10.0.0.2:30001 (repeat for each)",
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
        "--api-key-file",
        help="'tenant:key[:maxprio]' lines, as `serve`: each client's key is forwarded, so the workers need the same file",
    )
    parser.add_argument(
        "--admin-api-key",
        help=f"the key of control ops, as `serve` (or set {SECRETS['admin_api_key']})",
    )
    parser.add_argument(
        "--worker-api-key",
        help="what the router sends the workers (default: --admin-api-key, else --api-key, else the key file's first key)",
    )
    parser.add_argument(
        "--curve-client-keys", help="only these client CURVE public keys may connect, as `serve`"
    )
    parser.add_argument(
        "--max-frame-bytes",
        type=int,
        default=ServerArgs.max_frame_bytes,
        help=f"as `serve` (default: {ServerArgs.max_frame_bytes})",
    )
    parser.add_argument(
        "--max-prompt-bytes",
        type=int,
        default=ServerArgs.max_prompt_bytes,
        help=f"as `serve` (default: {ServerArgs.max_prompt_bytes})",
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
    secrets = {
        name: getattr(args, name) or os.environ.get(var) or None for name, var in SECRETS.items()
    }
    front = FrontConfig(
        secrets["api_key"],
        args.api_key_file,
        secrets["admin_api_key"],
        secrets["curve_secret_key"],
        args.curve_client_keys,
        args.max_frame_bytes,
        args.max_prompt_bytes,
    )
    front.check_exposure(args.host)
    config = RouterConfig(
        workers=tuple(args.worker),
        policy=args.policy,
        thresholds=CacheAwareThresholds(
            args.cache_threshold, args.balance_abs_threshold, args.balance_rel_threshold
        ),
        front=front,
        worker_api_key=args.worker_api_key
        or KeyRing.from_settings(front.api_key, front.api_key_file, front.admin_api_key).any_key(),
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
