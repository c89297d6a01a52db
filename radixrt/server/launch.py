"""`radixrt serve`'s process up to the model: the HTTP gateway's child is started first, bound to
`--port` (a busy port fails at once), so that its start (fastapi, uvicorn: about a second of
CPU) runs beside this process's imports of torch and the engine, not after them; then the
runtime (`zmq_server.serve`). Nothing here imports torch."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
from dataclasses import replace
from pathlib import Path

import zmq

from radixrt.config import SECRETS, GatewaySettings, ServerArgs
from radixrt.lifecycle import exit_with_parent, python_command
from radixrt.server.exposure import check_kv_events_exposure
from radixrt.server.front import FrontConfig


def run_server(args: ServerArgs) -> None:
    """Load the model, bind, serve until a `shutdown` op, SIGINT, or SIGTERM (which drains
    first: running and queued requests finish, up to `--drain-timeout`)."""
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s %(name)s] %(message)s")
    args = args.with_secrets_from_env().with_own_admin_key()  # its gateway's too
    front = FrontConfig.of(args)
    front.check_exposure(args.host)
    check_kv_events_exposure(args.kv_events, front.keyed)
    exit_with_parent()  # a runtime started by rt.Runtime / rt.Engine ends with its launcher
    gateway = None
    # before loading the model: a busy port fails at once, and the child starts meanwhile
    if not args.disable_http:
        gateway = start_gateway(args)  # it also exits by itself if this process dies
    try:  # a model that fails to load stops the gateway too
        from radixrt.server.zmq_server import serve  # torch and the engine: after the child

        serve(args)
    finally:
        if gateway is not None:
            stop_gateway(gateway)
    if args.endpoint.startswith("ipc://"):
        Path(args.endpoint.removeprefix("ipc://")).unlink(missing_ok=True)


STOP_TIMEOUT_S = 10


def start_gateway(args: ServerArgs) -> subprocess.Popen[bytes]:
    """Bind the HTTP port here (a busy port fails `serve` at once) and hand it to a gateway child."""
    host = args.http_host
    if not args.is_loopback and not (args.api_key or args.api_key_file or args.admin_api_key):
        raise SystemExit(f"refusing to serve HTTP on {host} without --api-key")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, args.port), family=family, backlog=1024)
    command = python_command(
        "-m",
        "radixrt",
        "http-gateway",
        "--url",
        args.endpoint,
        "--fd",
        str(sock.fileno()),
        "--parent-pid",
        str(os.getpid()),
        "--log-level",
        args.log_level,
        "--tool-call-parser",
        args.tool_call_parser,
        # the body bound is the frame's (a body becomes one frame to the runtime); --host the
        # address bound here, whose names a keyless gateway answers to
        *replace(GatewaySettings.of(args), host=host).to_cli_args(),
    )
    if args.api_key_file:
        command += ["--api-key-file", args.api_key_file]
    if args.reasoning_parser:
        command += ["--reasoning-parser", args.reasoning_parser]
    if args.curve_secret_key:
        # one argument: a Z85 key may start with "-", which argparse would take for a flag
        public = zmq.curve_public(args.curve_secret_key.encode()).decode()
        command += [f"--curve-server-key={public}"]
    env = dict(os.environ)
    for name in ("api_key", "admin_api_key"):
        if getattr(args, name):
            env[SECRETS[name]] = getattr(args, name)
    with sock:
        proc = subprocess.Popen(command, pass_fds=[sock.fileno()], env=env)
    return proc


def stop_gateway(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
