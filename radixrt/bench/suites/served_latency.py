"""What a served radixrt's front adds to a request, timed by a client in this process on
loopback, in turns so both sides see the same machine state:

- `--workload router-overhead`: one worker of `--model`, reached directly and through
  `radixrt router`, each of `--rounds` (40) sending one short fresh prompt each way (the order
  alternating), one at a time; each path's TTFT percentiles and the median of the per-round
  differences, into `router-overhead.json`;
- `--workload flood-latency`: each `--systems` variant (radixrt; `radixrt-dp2` a fleet) behind
  an API key; each of `--rounds` (5) times one 8-token greedy request alone, then one sent while
  another thread floods the socket with keyless one-byte frames; the medians, their ratio, the
  flood frames sent and the refusals that came back (the per-peer budget drops the rest), into
  `flood-latency.json`.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from radixrt.bench.registry import register
from radixrt.bench.report import BenchRun
from radixrt.bench.results import RunResult
from radixrt.bench.variants import VARIANTS

if TYPE_CHECKING:  # the client loads only when a suite runs
    from radixrt.client.endpoint import Endpoint

FLOOD_KEY = "flood-key"
FLOOD_PARAMS = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
FLOOD_SECONDS = 1.0  # of flood before the timed request
WARM_ROUNDS = 3


@dataclass(frozen=True)
class PathTtft:
    """router-overhead: one path's TTFT percentiles over the rounds (ms)."""

    path: str
    p50_ms: float
    p90_ms: float


@dataclass(frozen=True)
class FloodLatency:
    """flood-latency on one system: a request's median latency alone and during the flood
    (seconds), and the flood's frames sent and refusals answered over every round."""

    system: str
    alone_s: float
    flooded_s: float
    frames_sent: int
    refusals: int

    @property
    def ratio(self) -> float:
        return self.flooded_s / self.alone_s


@register("router-overhead")
def run_router_overhead(run: BenchRun) -> dict[str, list[RunResult]]:
    import radixrt as rt

    config = run.config
    rounds = config.rounds or 40
    pool = config.max_total_tokens or 8192
    with rt.Runtime(model=config.model, max_total_tokens=pool, log_level="warning") as worker:
        direct, via = _direct_and_routed(worker, rounds)
    diffs = [v - d for d, v in zip(direct, via)]
    paths = [_percentiles("direct", direct), _percentiles("router", via)]
    added_ms = statistics.median(diffs) * 1e3
    print(f"{rounds} rounds, model {config.model}")
    for p in paths:
        print(f"  {p.path:7s} TTFT p50 {p.p50_ms:7.2f} ms  p90 {p.p90_ms:7.2f} ms")
    print(f"  added by the router: median of per-round differences {added_ms:.2f} ms")
    run.write(
        "router-overhead",
        {
            "workload": "router-overhead",
            "rounds": rounds,
            "paths": [asdict(p) for p in paths],
            "added_ms_median": added_ms,
        },
    )
    return {}


def _direct_and_routed(worker: Endpoint, rounds: int) -> tuple[list[float], list[float]]:
    """`radixrt router` started in front of `worker`; each path's TTFT (seconds) per round."""
    import subprocess
    import sys

    from radixrt.client.endpoint import connect
    from radixrt.client.launcher import free_port

    port = free_port()
    command = [sys.executable, "-m", "radixrt", "router", "--port", str(port)]
    router = subprocess.Popen(command + ["--worker", worker.url, "--log-level", "warning"])
    routed = connect(f"tcp://127.0.0.1:{port}", timeout=60)
    try:
        _wait_for_worker(routed)
        for warm in range(WARM_ROUNDS):
            ttft(worker, f"Warm-up {warm}.")
            ttft(routed, f"Warm-up {warm}.")
        direct: list[float] = []
        via: list[float] = []
        for i in range(rounds):
            prompt = f"Question {i}: name a colour."  # fresh text: the same prefill either way
            paths = [(direct, worker, "direct"), (via, routed, "routed")][:: 1 if i % 2 else -1]
            for times, endpoint, name in paths:
                times.append(ttft(endpoint, f"{prompt} ({name})"))
        return direct, via
    finally:
        routed.close()
        router.terminate()
        router.wait(timeout=15)


def _wait_for_worker(routed: Endpoint) -> None:
    """Until the router reports its worker alive."""
    while True:
        try:
            if routed.stats()["workers"][0]["alive"]:
                return
        except TimeoutError:
            pass
        time.sleep(0.1)


def ttft(endpoint: Endpoint, prompt: str) -> float:
    """Seconds from sending a streamed greedy request to its first chunk."""
    start = time.perf_counter()
    for _ in endpoint.generate(prompt, {"max_new_tokens": 2, "temperature": 0}, stream=True):
        return time.perf_counter() - start
    raise AssertionError("no chunk")


def _percentiles(path: str, seconds: list[float]) -> PathTtft:
    def pct(q: float) -> float:
        return sorted(seconds)[min(int(q * len(seconds)), len(seconds) - 1)] * 1e3

    return PathTtft(path, pct(0.5), pct(0.9))


@register("flood-latency")
def run_flood_latency(run: BenchRun) -> dict[str, list[RunResult]]:
    config = run.config
    rounds = config.rounds or 5
    results = [
        _flood_latency(run, system, rounds) for system in config.systems_for("flood-latency")
    ]
    for r in results:
        print(
            f"{r.system} ({rounds} rounds): request alone median {r.alone_s * 1e3:.0f} ms, "
            f"during the flood {r.flooded_s * 1e3:.0f} ms ({r.ratio:.2f}x); flood frames sent "
            f"{r.frames_sent}, refusals answered {r.refusals}"
        )
    run.write(
        "flood-latency",
        {
            "workload": "flood-latency",
            "rounds": rounds,
            "results": [{**asdict(r), "ratio": r.ratio} for r in results],
        },
    )
    return {}


def _flood_latency(run: BenchRun, system: str, rounds: int) -> FloodLatency:
    import radixrt as rt
    from radixrt.client.endpoint import connect

    config = run.config
    server: dict[str, Any] = {
        "api_key": FLOOD_KEY,
        "disable_http": True,
        "max_total_tokens": config.max_total_tokens or 2048,
        "log_level": "warning",
        **VARIANTS[system],
    }
    alone, flooded, counts = [], [], {"sent": 0, "answered": 0}
    with rt.Runtime(config.model, **server) as runtime:
        client = connect(runtime.url, api_key=FLOOD_KEY, timeout=60)
        timed(client)  # warm
        for _ in range(rounds):
            alone.append(timed(client))
            stop = threading.Event()
            thread = threading.Thread(target=flood, args=(runtime.url, stop, counts))
            thread.start()
            time.sleep(FLOOD_SECONDS)
            flooded.append(timed(client))
            stop.set()
            thread.join()
        client.close()
    return FloodLatency(
        system,
        statistics.median(alone),
        statistics.median(flooded),
        counts["sent"],
        counts["answered"],
    )


def flood(url: str, stop: threading.Event, counts: dict[str, int]) -> None:
    """Send keyless one-byte frames to `url` until `stop`, counting them and the replies."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    while not stop.is_set():
        try:
            sock.send(b"\x01", zmq.NOBLOCK)
            counts["sent"] += 1
        except zmq.Again:
            time.sleep(0.0005)
        while sock.poll(0):
            sock.recv()
            counts["answered"] += 1
    ctx.destroy(linger=0)


def timed(endpoint: Endpoint) -> float:
    """Seconds one FLOOD_PARAMS request takes, from sending to its answer."""
    start = time.perf_counter()
    endpoint.generate(input_ids=[5, 6, 7, 8], sampling_params=FLOOD_PARAMS)
    return time.perf_counter() - start
