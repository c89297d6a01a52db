"""`radixrt serve --dp-size N`: N workers and the router in front of them, in one command.

Each worker is an ordinary `radixrt serve` on a private ipc:// socket, with its share of the
cores (OMP_NUM_THREADS) or its own GPUs (CUDA_VISIBLE_DEVICES); the router binds the ZeroMQ port,
and the HTTP gateway on --port sits in front of the router (unless --disable-http). Stopping the router (shutdown op,
Ctrl-C) stops the workers. SIGTERM drains the fleet: the router refuses new generates and the
workers get SIGTERM too, so they finish what they hold and exit; the fleet exits 0 once they all
have, each with 0.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import subprocess
import threading
from typing import Any

import zmq

from radixrt.client.launcher import Engine
from radixrt.config import RouterSettings, ServerArgs, WorkerSettings, physical_cores
from radixrt.lifecycle import exit_with_parent
from radixrt.server.front import FrontConfig
from radixrt.server.launch import start_gateway, stop_gateway
from radixrt.server.router.router import DRAIN_SLACK_S, Router, RouterConfig
from radixrt.server.tenants import KeyRing

logger = logging.getLogger(__name__)

WORKERS_JOIN_S = 30.0  # healthy workers answer the router's first ping within milliseconds


class FleetWorker(Engine):
    """A worker process with its own environment (threads, devices); logs on this stderr."""

    def __init__(self, env: dict[str, str], args: ServerArgs):
        self._extra_env = env
        super().__init__(**dataclasses.asdict(args))

    def _env(self) -> dict[str, str]:
        return {**super()._env(), **self._extra_env}

    def begin_drain(self) -> None:
        """Forward the fleet's SIGTERM: the worker refuses new generates, finishes what it
        holds (up to its --drain-timeout), and exits."""
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)

    def wait_exit(self, timeout: float) -> int | None:
        """The worker's exit code once it has exited, None if it is still running after
        `timeout` seconds."""
        try:
            return self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None


def worker_envs(args: ServerArgs) -> list[dict[str, str]]:
    """Each worker's share: `--cpu-threads` (default: the physical cores) `// (dp * tp)`
    threads a rank on the CPU, `tp` GPUs on CUDA."""
    if _on_cuda(args.device):
        return [
            {
                "CUDA_VISIBLE_DEVICES": ",".join(
                    str(i * args.tp_size + r) for r in range(args.tp_size)
                )
            }
            for i in range(args.dp_size)
        ]
    cores = args.cpu_threads or physical_cores()
    threads = max(1, cores // (args.dp_size * args.tp_size) * args.tp_size)
    return [{"OMP_NUM_THREADS": str(threads)} for _ in range(args.dp_size)]


def _on_cuda(device: str) -> bool:
    if device == "cpu":
        return False
    import torch  # only to count GPUs

    return torch.cuda.is_available()


def start_workers(args: ServerArgs) -> list[FleetWorker]:
    """Start every worker at once and wait until all are healthy (any failure stops the rest).
    Each gets the keys (file, admin key), so it sees the tenant of each forwarded client key;
    not the CURVE allowlist, which is the router's: the router's links use their own key pairs."""
    worker_args = dataclasses.replace(args, dp_size=1, disable_http=True, curve_client_keys=None)
    workers: list[Any] = [None] * args.dp_size
    errors: list[BaseException] = []

    def start(i: int, env: dict[str, str]) -> None:
        try:
            workers[i] = FleetWorker(env, worker_args)
        except BaseException as e:  # noqa: B036 (re-raised below, after the others stopped)
            errors.append(e)

    threads = [
        threading.Thread(target=start, args=(i, env)) for i, env in enumerate(worker_envs(args))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        stop_workers([w for w in workers if w is not None])
        raise errors[0]
    return workers


def stop_workers(workers: list[FleetWorker]) -> None:
    for w in workers:
        w.shutdown()


def router_config(args: ServerArgs, urls: list[str]) -> RouterConfig:
    public = (
        zmq.curve_public(args.curve_secret_key.encode()).decode() if args.curve_secret_key else None
    )
    fleet = WorkerSettings(
        worker=tuple(urls),
        worker_api_key=KeyRing.from_settings(
            args.api_key, args.api_key_file, args.admin_api_key
        ).any_key(),
        worker_curve_server_key=public,
    )
    return RouterConfig(fleet=fleet, routing=RouterSettings.of(args), front=FrontConfig.of(args))


def run_fleet(args: ServerArgs) -> None:
    """Serve `args.dp_size` workers behind a router until a shutdown op, SIGINT, or SIGTERM
    (which drains the router and the workers first). A drained fleet whose workers did not all
    exit 0 exits 1."""
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s %(name)s] %(message)s")
    args = args.with_own_admin_key()  # the router's and the gateway's, which the workers take
    FrontConfig.of(args).check_exposure(args.host)
    exit_with_parent()  # and the workers, which watch this process, follow
    gateway = None
    if not args.disable_http:  # before the workers load: a busy port fails at once
        gateway = start_gateway(args)
    workers = []
    try:
        workers = start_workers(args)
        router = Router(router_config(args, [w.args.endpoint for w in workers]), args.endpoint)
        router.wait_for_workers(WORKERS_JOIN_S)

        def stop(*_: Any) -> None:
            router.running = False

        def drain(*_: Any) -> None:
            router.begin_drain()
            for w in workers:
                w.begin_drain()

        signal.signal(signal.SIGTERM, drain)
        signal.signal(signal.SIGINT, stop)
        logger.info(
            "routing %d workers on %s (%s)", len(workers), args.endpoint, args.router_policy
        )
        router.serve_forever()
        failed = _drained_workers_failed(workers) if router.drain_deadline is not None else []
    finally:
        stop_workers(workers)
        if gateway is not None:
            stop_gateway(gateway)
    if failed:
        raise SystemExit(f"drained, but workers did not exit 0: {'; '.join(failed)}")


def _drained_workers_failed(workers: list[FleetWorker]) -> list[str]:
    """Wait for the draining workers to exit (they end what is left at their own deadline,
    which the router's has passed by now); name each that did not exit 0 in time."""
    failed = []
    for w in workers:
        code = w.wait_exit(DRAIN_SLACK_S)
        if code != 0:
            failed.append(f"{w.args.endpoint}: {'still running' if code is None else code}")
    return failed
