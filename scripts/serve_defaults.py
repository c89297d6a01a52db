"""radixrt against llama.cpp's llama-server on one GGUF file, each started with its default flags
only (`radixrt serve --model F`, `llama-server -m F`), as a new user meets them (issue 54):

- time from the command to a healthy /health;
- one stream: requests one after another through /v1/completions, greedy, a fixed output length;
- nothing shared: `--clients` clients at once, each prompt its own random words;
- peak resident memory of the whole serving process tree (the server and every child, summed,
  sampled every 20 ms from /proc) while it starts and serves one stream, and over the run.

    python scripts/serve_defaults.py --model model-Q4_0.gguf [--llama-server PATH]
"""

from __future__ import annotations

import argparse
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

HEALTH_TIMEOUT_S = 600.0
SAMPLE_S = 0.02
WORDS = "river stone light cloud paper garden silver window market forest".split()


@dataclass
class Figures:
    """One server's figures (see the module's docstring)."""

    system: str
    healthy_s: float
    one_stream_tok_s: float
    clients_tok_s: float
    one_stream_peak_mb: float
    peak_mb: float


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


def _request(port: int, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, data, {"Content-Type": "application/json"})
        response = conn.getresponse()
        text = response.read()
        return response.status, json.loads(text) if text.strip().startswith(b"{") else {}
    finally:
        conn.close()


def _wait_healthy(port: int, proc: subprocess.Popen) -> None:
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


def measure(system: str, command: list[str], port: int, args: argparse.Namespace) -> Figures:
    """Start `command`, time it to healthy, run both loads, stop it."""
    rng = random.Random(0)
    start = time.monotonic()
    proc = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL)
    rss = TreeRss(proc.pid)
    try:
        _wait_healthy(port, proc)
        healthy = time.monotonic() - start
        one = [_prompt(rng, 32) for _ in range(args.one_stream_requests)]
        one_stream = _throughput(port, one, args.one_stream_tokens, 1)
        one_peak = rss.peak_kb
        many = [_prompt(rng, 128) for _ in range(2 * args.clients)]
        clients = _throughput(port, many, args.clients_tokens, args.clients)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
        rss.stop()
    return Figures(system, healthy, one_stream, clients, one_peak / 1024, rss.peak_kb / 1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a .gguf file")
    beside = Path(sys.executable).parent / "llama-server"  # where `make bench-peers` puts it
    parser.add_argument("--llama-server", default=str(beside))
    parser.add_argument("--port", type=int, default=31000)
    parser.add_argument("--one-stream-requests", type=int, default=4)
    parser.add_argument("--one-stream-tokens", type=int, default=128)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--clients-tokens", type=int, default=64)
    parser.add_argument("--output", help="write the figures here as JSON")
    args = parser.parse_args()
    radixrt = [sys.executable, "-m", "radixrt", "serve", "--model", args.model]
    runs = [
        ("radixrt", radixrt + ["--port", str(args.port)]),
        ("llama-server", [args.llama_server, "-m", args.model, "--port", str(args.port)]),
    ]
    figures = [measure(name, cmd, args.port, args) for name, cmd in runs]
    print(f"{Path(args.model).name}, default flags on both sides")
    print("| system | to healthy s | one stream tok/s | "
          f"{args.clients} clients tok/s | peak RSS one stream MB | peak RSS MB |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for f in figures:
        print(
            f"| {f.system} | {f.healthy_s:.1f} | {f.one_stream_tok_s:.1f} | "
            f"{f.clients_tok_s:.1f} | {f.one_stream_peak_mb:.0f} | {f.peak_mb:.0f} |"
        )
    if args.output:
        Path(args.output).write_text(json.dumps([asdict(f) for f in figures], indent=1))


if __name__ == "__main__":
    main()
