"""`radixrt` command line: serve, generate, bench, prepare-model."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import zmq

from radixrt.client.launcher import RuntimeStartError
from radixrt.config import SECRETS, GatewaySettings, RouterArgs, ServerArgs


def _prepare_model(args: argparse.Namespace) -> None:
    from radixrt.executor.model_loader import resolve_model_path

    print(resolve_model_path(args.model))


def _serve(args: argparse.Namespace) -> None:
    server_args = ServerArgs.from_cli_args(args)
    if server_args.node_rank > 0:  # another machine of a tensor-parallel group: ranks only
        from radixrt.executor.tp_worker import run_node

        sys.exit(run_node(server_args.executor))
    if server_args.dp_size > 1:  # workers behind a router
        from radixrt.server.router.fleet import run_fleet

        run_fleet(server_args.with_secrets_from_env())
    else:
        from radixrt.server.launch import run_server

        run_server(server_args)
    _leave()


def _leave() -> None:
    """End a server whose work is done: run the exit handlers (temporary folders, child
    processes), flush, and skip the interpreter's teardown of every module, which with torch
    loaded takes seconds that each stopping runtime (and each test) would wait for."""
    import atexit
    import logging

    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _http_gateway(args: argparse.Namespace) -> None:
    from radixrt.server.http.process import run_gateway

    limits = GatewaySettings.from_cli_args(args)
    run_gateway(
        args.url,
        args.fd,
        args.parent_pid,
        os.environ.get(SECRETS["api_key"]),
        args.curve_server_key,
        args.log_level,
        args.tool_call_parser,
        args.api_key_file,
        os.environ.get(SECRETS["admin_api_key"]),
        limits,
        args.reasoning_parser,
    )


def _router(args: argparse.Namespace) -> None:
    from radixrt.server.router.main import run_router

    run_router(RouterArgs.from_cli_args(args).with_secrets_from_env())


def _generate(args: argparse.Namespace) -> None:
    from radixrt.client.endpoint import connect
    from radixrt.client.launcher import Engine

    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    backend = (
        connect(args.url)
        if args.url
        else Engine(**dataclasses.asdict(ServerArgs.from_cli_args(args)))
    )
    with backend:
        if args.stream:
            for chunk in backend.generate(args.prompt, params, stream=True):
                if not chunk["finished"]:  # the final map repeats the whole text
                    print(chunk["delta"], end="", flush=True)
            print()
        else:
            out = backend.generate(args.prompt, params)
            assert isinstance(out, dict), "one prompt, one sample"
            print(out["text"])
            print(json.dumps(out["meta_info"]), file=sys.stderr)


def _bench(args: argparse.Namespace) -> None:
    from radixrt.bench.config import BenchConfig
    from radixrt.bench.runner import run_bench

    run_bench(BenchConfig.from_cli_args(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixrt", description="RadixAttention-centric LLM runtime"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    prep = sub.add_parser(
        "prepare-model",
        help="read a GGUF's config and tokenizer once (checked first), print their folder",
    )
    prep.add_argument("--model", default="default")
    prep.set_defaults(func=_prepare_model)

    serve = sub.add_parser(
        "serve", help="run the runtime: HTTP on --port, the ZeroMQ protocol on --zmq-port"
    )
    ServerArgs.add_cli_args(serve)
    serve.set_defaults(func=_serve)

    gateway = sub.add_parser(
        "http-gateway",
        help="the HTTP front (OpenAI and SGLang-native APIs) that `serve` starts on --port",
    )
    gateway.add_argument("--url", required=True, help="the runtime's ZeroMQ address")
    gateway.add_argument(
        "--fd", type=int, required=True, help="listening socket inherited from `serve`"
    )
    gateway.add_argument("--parent-pid", type=int, help="exit when this process is gone")
    gateway.add_argument("--curve-server-key", help="the runtime's CURVE public key")
    gateway.add_argument("--api-key-file", help="the runtime's 'tenant:key' file")
    gateway.add_argument("--log-level", default="info")
    gateway.add_argument("--tool-call-parser", default="auto", help="see `serve --help`")
    gateway.add_argument("--reasoning-parser", help="see `serve --help`")
    # serve's own settings of the gateway (`--host`: the address serve bound for it)
    GatewaySettings.add_cli_args(gateway)
    gateway.set_defaults(func=_http_gateway)

    router = sub.add_parser(
        "router", help="route clients over several `radixrt serve` workers (data parallelism)"
    )
    RouterArgs.add_cli_args(router)
    router.set_defaults(func=_router)

    gen = sub.add_parser("generate", help="generate text against a server (--url) or in-process")
    ServerArgs.add_cli_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument(
        "--url",
        help="a running server, e.g. http://127.0.0.1:30000 or tcp://127.0.0.1:30001; in-process when absent",
    )
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.set_defaults(func=_generate)

    bench = sub.add_parser("bench", help="serving benchmarks (see `radixrt bench --help`)")
    from radixrt.bench.config import BenchConfig

    BenchConfig.add_cli_args(bench)
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Run a command; bad input (a setting, a model path, a busy port, a runtime that cannot
    start) is one line on stderr and exit status 2, not a traceback."""
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, OSError, RuntimeStartError, zmq.ZMQError) as e:
        print(f"radixrt {args.command}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
