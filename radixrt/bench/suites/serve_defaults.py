"""`--workload serve-defaults`: radixrt against llama.cpp's llama-server on the one GGUF file
`--model` names, each started with its default flags only (`radixrt serve --model F`,
`llama-server -m F`), as a new user meets them (issue 54):

- time from the command to a healthy /health;
- one stream: `--num-requests` (4) requests one after another through /v1/completions, greedy,
  ONE_STREAM_TOKENS each;
- nothing shared: `--concurrency` (32) clients at once, twice as many prompts, each its own
  random words, CLIENT_TOKENS each;
- a shared prefix: as many clients and prompts, each SHARED_WORDS words every prompt begins
  with (a system prompt) and QUESTION_WORDS of its own, CLIENT_TOKENS each (both servers reuse
  what they cached of the prefix: radixrt's radix tree, llama-server's slots' prompt caches);
- peak resident memory of the whole serving process tree (the server and every child, summed,
  sampled every 20 ms from /proc) while it starts and serves one stream, and over the run.

llama-server is the one `make bench-peers` built (`peers.llama_cpp_tool`). Into
`serve-defaults.json`.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from radixrt.bench.registry import register
from radixrt.bench.report import BenchRun
from radixrt.bench.results import RunResult

HEALTH_TIMEOUT_S = 600.0
SAMPLE_S = 0.02
WORDS = "river stone light cloud paper garden silver window market forest".split()
ONE_STREAM_REQUESTS = 4
ONE_STREAM_TOKENS = 128
CLIENTS = 32
CLIENT_TOKENS = 64
SHARED_WORDS = 200  # ~250 tokens: with a question and the reply, within a llama-server slot's
QUESTION_WORDS = 16  # context at its defaults (the model's context over 4 slots)


@dataclass(frozen=True)
class Figures:
    """One server's figures (see the module's docstring)."""

    system: str
    healthy_s: float
    one_stream_tok_s: float
    clients_tok_s: float
    shared_prefix_tok_s: float
    one_stream_peak_mb: float
    peak_mb: float


@dataclass(frozen=True)
class Loads:
    """What each server is sent: the one stream's requests, and the clients at once."""

    one_stream_requests: int
    clients: int


class TreeRss:
    """The peak summed VmRSS of a process and its descendants, sampled on a thread."""

    def __init__(self, pid: int):
        self.pid, self.peak_kb, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_kb = max(self.peak_kb, sum(_rss_kb(p) for p in _tree(self.pid)))
            time.sleep(SAMPLE_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@register("serve-defaults")
def run_serve_defaults(run: BenchRun) -> dict[str, list[RunResult]]:
    from radixrt.bench.peers import LLAMA_SERVER_MISSING, llama_cpp_tool
    from radixrt.client.launcher import free_port

    gguf = Path(run.config.model)
    if gguf.suffix != ".gguf" or not gguf.is_file():
        raise ValueError(f"--workload serve-defaults serves a .gguf file: --model {gguf}")
    llama_server = llama_cpp_tool("llama-server")
    if llama_server is None:
        raise FileNotFoundError(LLAMA_SERVER_MISSING)
    loads = Loads(run.config.num_requests or ONE_STREAM_REQUESTS, run.config.concurrency or CLIENTS)
    port = free_port()
    commands = {
        "radixrt": [sys.executable, "-m", "radixrt", "serve", "--model", str(gguf)],
        "llama-server": [str(llama_server), "-m", str(gguf)],
    }
    figures = [
        measure(name, [*cmd, "--port", str(port)], port, loads) for name, cmd in commands.items()
    ]
    _print(gguf, figures, loads)
    run.write(
        "serve-defaults",
        {"workload": "serve-defaults", **asdict(loads), "results": [asdict(f) for f in figures]},
    )
    return {}


def measure(system: str, command: list[str], port: int, loads: Loads) -> Figures:
    """Start `command` (serving on `port`), time it to healthy, run both loads, stop it."""
    rng = random.Random(0)
    start = time.monotonic()
    proc = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL)
    rss = TreeRss(proc.pid)
    try:
        _wait_healthy(port, proc)
        healthy = time.monotonic() - start
        one = [_prompt(rng, 32) for _ in range(loads.one_stream_requests)]
        one_stream = _throughput(port, one, ONE_STREAM_TOKENS, 1)
        one_peak = rss.peak_kb
        many = [_prompt(rng, 128) for _ in range(2 * loads.clients)]
        clients = _throughput(port, many, CLIENT_TOKENS, loads.clients)
        prefix = _prompt(rng, SHARED_WORDS)
        shared = [f"{prefix} {_prompt(rng, QUESTION_WORDS)}" for _ in range(2 * loads.clients)]
        shared_prefix = _throughput(port, shared, CLIENT_TOKENS, loads.clients)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
        rss.stop()
    return Figures(
        system, healthy, one_stream, clients, shared_prefix, one_peak / 1024, rss.peak_kb / 1024
    )


def _print(gguf: Path, figures: list[Figures], loads: Loads) -> None:
    print(f"{gguf.name}, default flags on both sides")
    print(
        f"| system | to healthy s | one stream tok/s | {loads.clients} clients tok/s "
        f"| {loads.clients} clients, shared prefix tok/s | peak RSS one stream MB | peak RSS MB |"
    )
    print("|---|---|---|---|---|---|---|")
    for f in figures:
        print(
            f"| {f.system} | {f.healthy_s:.1f} | {f.one_stream_tok_s:.1f} | "
            f"{f.clients_tok_s:.1f} | {f.shared_prefix_tok_s:.1f} | {f.one_stream_peak_mb:.0f} | "
            f"{f.peak_mb:.0f} |"
        )


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (through /proc/PID/task/*/children)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return found


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("VmRSS")), 0)
    except OSError:
        return 0


def _request(
    port: int, method: str, path: str, body: dict[str, Any] | None = None
) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, data, {"Content-Type": "application/json"})
        response = conn.getresponse()
        text = response.read()
        reply: dict[str, Any] = json.loads(text) if text.strip().startswith(b"{") else {}
        return response.status, reply
    finally:
        conn.close()


def _wait_healthy(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if _request(port, "GET", "/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError("not healthy in time")


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _tokens(port: int, prompt: str, max_tokens: int) -> int:
    """One greedy completion of exactly `max_tokens` tokens; the tokens it returned."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    status, reply = _request(port, "POST", "/v1/completions", body)
    if status != 200:
        raise RuntimeError(f"/v1/completions: HTTP {status} {reply}")
    return int(reply["usage"]["completion_tokens"])


def _throughput(port: int, prompts: list[str], max_tokens: int, clients: int) -> float:
    """Output tokens a second of `prompts` sent by `clients` clients at once."""
    start = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        total = sum(pool.map(lambda p: _tokens(port, p, max_tokens), prompts))
    return total / (time.monotonic() - start)
