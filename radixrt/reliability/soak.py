"""`make soak`: one runtime on loopback under a bounded, hostile mixed load; it stops by itself.

N client processes (one tenant each; keys from an `--api-key-file`) send, until a deadline,
plain requests, streams (some abandoned midway), forks (a pinned prefix and two branches), regex
and JSON-schema constraints, long prompts and bursts past the per-tenant limit, at two
priorities, some with a cache salt and some with a short timeout. Meanwhile the soak SIGKILLs a
client now and then (and times until the runtime has ended its requests), sends malformed
frames (issue 39's hostile shapes among them, and a keyless flood) on raw DEALER sockets, runs the `check_invariants` op every few seconds, samples the
runtime's RSS, and restarts the server once (SIGTERM: a drain, which must exit 0). At the end it
checks that no KV slot or request row leaked, and writes `soak.json`, `soak.md` and `rss.png`.

Every address is 127.0.0.1; every wait is bounded; clients stop at the deadline.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeAlias

import msgpack
import zmq

from radixrt.bench.metrics import percentile
from radixrt.bench.plots import plot_rss
from radixrt.client.base import Endpoint, Params, Results
from radixrt.client.endpoint import RequestOptions, ZmqEndpoint
from radixrt.client.launcher import free_port
from radixrt.client.transport import RemoteError
from radixrt.lifecycle import python_command
from radixrt.reliability.hostile import frame_attacks

ADMIN_KEY = "soak-admin"
PRIORITIES = (0, 5)
REPLY_TIMEOUT_S = 60.0
CHECK_EVERY_S = 5.0
BAD_FRAMES_EVERY_S = 10.0
RSS_EVERY_S = 2.0
ABORT_WAIT_S = 15.0  # longest a killed client's requests are waited for
# codes that mean "not now": a client waits this long before its next request, as Retry-After says
BACK_OFF_S = {"draining": 1.0, "rate_limited": 0.5, "overloaded": 0.5, "connection_lost": 1.0}
SYSTEMS = [
    "You are a terse assistant. Answer in one short sentence. ",
    "You are a careful reviewer of code. Point out one problem only. ",
    "You translate English into plain French, nothing else. ",
]
KINDS = ("plain", "plain", "stream", "fork", "constraint", "long", "burst")
BAD_FRAMES = [
    b"\x00not msgpack\xff",
    b"\x80\x04\x95pickle-looking bytes",
    msgpack.packb([1, 2, 3]),
    msgpack.packb({"op": "no_such_op", "rid": "bad-1"}),
    msgpack.packb({"op": "generate", "rid": "bad-2", "input_ids": "abc"}),
    msgpack.packb({"op": "generate", "rid": "bad-3", "text": "hi", "priority": "urgent"}),
    *frame_attacks(None),
]
FLOOD_FRAMES = 2000  # keyless one-byte frames sent with each round of malformed ones


@dataclass
class Outcome:
    """One client request as its client saw it (a JSON line on the client's stdout)."""

    kind: str
    priority: int
    latency: float
    ttft: float | None = None
    error: str | None = None


@dataclass
class SoakConfig:
    model: str
    duration_s: float
    clients: int
    output_dir: Path
    seed: int = 0
    max_total_tokens: int = 4096
    kill_every_s: float = 15.0
    server_flags: tuple[str, ...] = ()  # more of `radixrt serve`'s flags (a host tier, swap)


@dataclass
class SoakReport:
    duration_s: float
    clients: int
    served: int = 0
    outcomes_by_kind: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    latency: dict[str, dict[str, float]] = field(default_factory=dict)
    rss_mb: list[tuple[float, int, float]] = field(default_factory=list)  # (t, instance, MB)
    rss_growth: float | None = None
    leaked_slots: int | None = None
    leaked_rows: int | None = None
    leaked_state_slots: int | None = None  # a recurrent model's (0 for any other)
    abort_times_s: list[float] = field(default_factory=list)
    server_deaths: int = 0
    restart_exit_code: int | None = None
    final_exit_code: int | None = None
    invariant_checks: int = 0
    invariant_failures: list[str] = field(default_factory=list)
    malformed_sent: int = 0
    malformed_answered: int = 0

    def passed(self) -> bool:
        """The soak's targets (docs/reliability.md)."""
        return (
            self.leaked_slots == 0
            and self.leaked_rows == 0
            and not self.leaked_state_slots
            and self.server_deaths == 0
            and self.restart_exit_code == 0
            and self.final_exit_code == 0
            and not self.invariant_failures
            and all(t <= 6.0 for t in self.abort_times_s)
            and (self.rss_growth is None or self.rss_growth <= 0.05)
        )


# ---- a client process ---------------------------------------------------------------------
def run_client(url: str, key: str, seed: int, until: float) -> None:
    """Send requests until the wall-clock time `until`, one JSON `Outcome` line per request."""
    rng = random.Random(seed)
    endpoint = ZmqEndpoint(url, api_key=key, timeout=REPLY_TIMEOUT_S)
    while time.time() < until:
        kind, priority = rng.choice(KINDS), rng.choice(PRIORITIES)
        options = RequestOptions(
            cache_salt=rng.choice([None, None, "salted"]),
            priority=priority,
            timeout=1.0 if rng.random() < 0.05 else None,
        )
        start = time.monotonic()
        outcome = Outcome(kind, priority, 0.0)
        try:
            outcome.ttft = REQUESTS[kind](endpoint, rng, options)
        except RemoteError as e:
            outcome.error = e.code
        except TimeoutError:
            outcome.error = "client_timeout"
        outcome.latency = time.monotonic() - start
        print(json.dumps(asdict(outcome)), flush=True)
        time.sleep(0.0 if outcome.error is None else BACK_OFF_S.get(outcome.error, 0.0))
    endpoint.close()


def _question(rng: random.Random) -> str:
    return rng.choice(SYSTEMS) + f"Question {rng.randrange(10_000)}: what is {rng.randrange(99)}?"


def _ttft(results: Results) -> float:
    """The time to first token of one prompt's one sample."""
    assert isinstance(results, dict), "one prompt, one sample: one result"
    ttft: float = results["meta_info"]["ttft"]
    return ttft


def _plain(endpoint: ZmqEndpoint, rng: random.Random, options: RequestOptions) -> float:
    params = {"max_new_tokens": rng.randrange(4, 24), "temperature": rng.choice([0, 0.8])}
    return _ttft(endpoint.generate(_question(rng), params, options=options))


def _stream(endpoint: ZmqEndpoint, rng: random.Random, options: RequestOptions) -> float | None:
    """A stream, short or long (what a killed client is likely caught in); a third of them are
    abandoned after a few chunks (which aborts them). None: no chunk came."""
    start, ttft = time.monotonic(), None
    params = {"max_new_tokens": rng.choice([48, 256]), "ignore_eos": True}
    chunks = endpoint.generate(_question(rng), params, stream=True, options=options)
    stop_after = rng.randrange(2, 8) if rng.random() < 0.33 else None
    for i, _ in enumerate(chunks):
        ttft = ttft or time.monotonic() - start
        if stop_after is not None and i >= stop_after:
            chunks.close()
            break
    return ttft


def _fork(endpoint: ZmqEndpoint, rng: random.Random, options: RequestOptions) -> float:
    """What `s.fork(2)` does: prefill the prefix, pin it, run two branches, unpin."""
    prefix = _question(rng)
    endpoint.generate(prefix, {"max_new_tokens": 0}, options=options)
    pin_id = f"soak-{rng.randrange(1 << 30)}"
    endpoint.pin(pin_id, prefix, options)
    try:
        outs = [
            endpoint.generate(prefix + branch, {"max_new_tokens": 8}, options=options)
            for branch in (" First,", " Second,")
        ]
    finally:
        endpoint.unpin(pin_id)
    return _ttft(outs[0])


def _constraint(endpoint: ZmqEndpoint, rng: random.Random, options: RequestOptions) -> float:
    constraint = rng.choice(
        [
            {"regex": "(yes|no)"},
            {
                "json_schema": json.dumps(
                    {"type": "object", "properties": {"n": {"type": "integer"}}}
                )
            },
        ]
    )
    params: Params = {**constraint, "max_new_tokens": 24}
    return _ttft(endpoint.generate(_question(rng), params, options=options))


def _long(endpoint: ZmqEndpoint, rng: random.Random, options: RequestOptions) -> float:
    prompt = " ".join(rng.choice(SYSTEMS) for _ in range(rng.randrange(20, 40)))
    return _ttft(endpoint.generate(prompt, {"max_new_tokens": 4}, options=options))


def _burst(endpoint: ZmqEndpoint, rng: random.Random, options: RequestOptions) -> float:
    """Six at once: past the per-tenant in-flight limit, so some are `rate_limited`."""
    subs = [
        endpoint.client.submit(
            text=_question(rng), sampling_params={"max_new_tokens": 4}, **options.fields()
        )
        for _ in range(6)
    ]
    errors = []
    for sub in subs:
        try:
            sub.finals(REPLY_TIMEOUT_S)
        except RemoteError as e:
            errors.append(e)
    if errors:
        raise errors[0]
    return 0.0


# one request of a kind; returns its time to first token where it has one
Request: TypeAlias = Callable[[ZmqEndpoint, random.Random, RequestOptions], float | None]

REQUESTS: dict[str, Request] = {
    "plain": _plain,
    "stream": _stream,
    "fork": _fork,
    "constraint": _constraint,
    "long": _long,
    "burst": _burst,
}


# ---- the server under test ------------------------------------------------------------------
class SoakServer:
    """`radixrt serve` as a child process on a fixed loopback ZeroMQ port, restartable."""

    def __init__(self, cfg: SoakConfig, key_file: Path, log: Path):
        self.port = free_port()
        self.url = f"tcp://127.0.0.1:{self.port}"
        self.command = python_command(
            "-m",
            "radixrt",
            "serve",
            "--model",
            cfg.model,
            "--host",
            "127.0.0.1",
            "--zmq-port",
            str(self.port),
            "--disable-http",  # the soak's clients speak ZeroMQ
            "--max-total-tokens",
            str(cfg.max_total_tokens),
            "--max-running-requests",
            "16",
            # a step's time bounds how soon a silent client is noticed: keep long prefills chunked
            "--chunked-prefill-size",
            "256",
            "--api-key-file",
            str(key_file),
            "--enable-priority-preemption",
            "--max-inflight-per-tenant",
            "4",
            "--max-queued-tokens-per-tenant",
            "4000",
            "--drain-timeout",
            "10",
            "--log-level",
            "warning",
            *cfg.server_flags,
        )
        self.env = {**os.environ, "RADIXRT_API_KEY": ADMIN_KEY, "RADIXRT_ADMIN_API_KEY": ADMIN_KEY}
        self.log = log.open("ab")
        self.instance = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, admin: Endpoint | None = None) -> None:
        self.instance += 1
        self.proc = subprocess.Popen(
            self.command, env=self.env, stdout=self.log, stderr=subprocess.STDOUT
        )
        if admin is not None:
            wait_healthy(admin, self.proc)

    def drain_and_stop(self) -> int:
        """SIGTERM (a drain), then the exit code; a process that hangs is killed (code -9)."""
        assert self.proc is not None, "a started server"
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def wait_healthy(admin: Endpoint, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} while starting")
        try:
            admin.health(timeout=1)
            return
        except (TimeoutError, RemoteError):
            pass
    raise RuntimeError("the server did not come up")


# ---- the soak -------------------------------------------------------------------------------
class Soak:
    def __init__(self, cfg: SoakConfig):
        self.cfg = cfg
        cfg.output_dir.mkdir(parents=True, exist_ok=True)
        self.keys = {
            f"tenant{i}": f"key-{i}-{random.Random(cfg.seed + i).getrandbits(64):x}"
            for i in range(cfg.clients)
        }
        key_file = cfg.output_dir / "keys.txt"
        key_file.write_text("".join(f"{t}:{k}\n" for t, k in self.keys.items()))
        self.server = SoakServer(cfg, key_file, cfg.output_dir / "server.log")
        self.admin = ZmqEndpoint(self.server.url, api_key=ADMIN_KEY, timeout=REPLY_TIMEOUT_S)
        self.report = SoakReport(cfg.duration_s, cfg.clients)
        self.outcomes: list[Outcome] = []
        self.lock = threading.Lock()
        self.clients: dict[int, subprocess.Popen[str]] = {}
        self.start = time.time()
        self.until = self.start + cfg.duration_s
        self.spawned = 0

    def run(self) -> SoakReport:
        self.server.start(self.admin)
        self.free_rows = self.admin.stats()["free_request_rows"]  # all of them, at the start
        for slot in range(self.cfg.clients):
            self._spawn(slot)
        self._loop()
        self._finish()
        return self.report

    def _spawn(self, slot: int) -> None:
        tenant = f"tenant{slot}"
        command = python_command(
            "-m", "radixrt.reliability.soak", "client",
            "--url", self.server.url, "--key", self.keys[tenant],
            "--seed", str(self.cfg.seed * 1000 + self.spawned), "--until", str(self.until),
        )  # fmt: skip
        self.spawned += 1
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        self.clients[slot] = proc
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None, "a client's stdout is a pipe"
        for line in proc.stdout:
            with self.lock:
                self.outcomes.append(Outcome(**json.loads(line)))

    def _loop(self) -> None:
        now = time.time()
        due = {"kill": now + self.cfg.kill_every_s, "check": now + CHECK_EVERY_S}
        due |= {
            "bad": now + BAD_FRAMES_EVERY_S,
            "rss": now,
            "restart": now + 0.25 * self.cfg.duration_s,
        }
        while (now := time.time()) < self.until - 2:
            assert self.server.proc is not None, "run started the server"
            if self.server.proc.poll() is not None:  # not a planned stop: a death
                self.report.server_deaths += 1
                self.server.start(self.admin)
            for task, at in list(due.items()):
                if now >= at:
                    due[task] = getattr(self, f"_{task}")(now)
            time.sleep(0.2)

    def _restart(self, now: float) -> float:
        self.report.restart_exit_code = self.server.drain_and_stop()
        self.server.start(self.admin)
        return float("inf")

    def _in_flight(self, tenant: str) -> int:
        counts = self.admin.stats()["tenants"].get(tenant, {})
        in_flight: int = counts.get("running", 0) + counts.get("waiting", 0)
        return in_flight

    def _kill(self, now: float) -> float:
        """SIGKILL a random client once it has a request in the runtime (waiting up to 5 s),
        time until the runtime has ended its tenant's requests, and start another in its slot."""
        slot = random.Random(now).randrange(self.cfg.clients)
        tenant = f"tenant{slot}"
        deadline = time.monotonic() + 5
        while not self._in_flight(tenant) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.clients[slot].kill()
        self.clients[slot].wait()
        killed = time.monotonic()
        while self._in_flight(tenant) and time.monotonic() - killed < ABORT_WAIT_S:
            time.sleep(0.1)
        self.report.abort_times_s.append(round(time.monotonic() - killed, 2))
        self._spawn(slot)
        return time.time() + self.cfg.kill_every_s

    def _check(self, now: float) -> float:
        self.report.invariant_checks += 1
        try:
            self.admin.check_invariants()
        except (RemoteError, TimeoutError) as e:
            self.report.invariant_failures.append(str(e))
        return time.time() + CHECK_EVERY_S

    def _bad(self, now: float) -> float:
        """Malformed frames on a raw DEALER; each must get an error reply (the server goes on)."""
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.server.url)
        flood = ctx.socket(zmq.DEALER)  # answered up to a burst, then dropped: not counted
        flood.setsockopt(zmq.LINGER, 0)
        flood.connect(self.server.url)
        for _ in range(FLOOD_FRAMES):
            flood.send(b"\x01")
        for frame in BAD_FRAMES:
            sock.send(frame)
        sock.send_multipart([b"two", b"frames"])  # dropped by the server, unanswered, not counted
        self.report.malformed_sent += len(BAD_FRAMES)
        deadline = time.monotonic() + 10
        answered = 0
        while answered < len(BAD_FRAMES) and time.monotonic() < deadline:
            if sock.poll(500):
                answered += "error" in msgpack.unpackb(sock.recv(), raw=False)
        self.report.malformed_answered += answered
        sock.close()
        flood.close()
        ctx.term()
        return time.time() + BAD_FRAMES_EVERY_S

    def _rss(self, now: float) -> float:
        import psutil

        assert self.server.proc is not None, "run started the server"
        try:
            rss = psutil.Process(self.server.proc.pid).memory_info().rss / 2**20
            self.report.rss_mb.append(
                (round(now - self.start, 1), self.server.instance, round(rss, 1))
            )
        except psutil.NoSuchProcess:
            pass
        return now + RSS_EVERY_S

    def _finish(self) -> None:
        for proc in self.clients.values():
            try:
                proc.wait(timeout=REPLY_TIMEOUT_S + 10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._wait_idle()
        self._check(time.time())
        self.admin.flush_cache()
        stats = self.admin.stats()
        self.report.leaked_slots = stats["total_tokens"] - stats["free_tokens"]
        self.report.leaked_rows = self.free_rows - stats["free_request_rows"]
        self.report.leaked_state_slots = stats["state_total_slots"] - stats["state_free_slots"]
        self.admin.close()
        self.report.final_exit_code = self.server.drain_and_stop()
        self._summarize()

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            stats = self.admin.stats()
            if stats["running"] == stats["waiting"] == stats["pins"] == 0:
                return
            time.sleep(0.2)

    def _summarize(self) -> None:
        r = self.report
        r.served = sum(o.error is None for o in self.outcomes)
        r.outcomes_by_kind = dict(Counter(o.kind for o in self.outcomes))
        r.errors = dict(Counter(o.error for o in self.outcomes if o.error))
        for p in PRIORITIES:
            ok = [o for o in self.outcomes if o.priority == p and o.error is None]
            ttfts = [o.ttft for o in ok if o.ttft]
            r.latency[f"priority {p}"] = {
                "requests": len(ok),
                "ttft_p50_s": round(percentile(ttfts, 50), 3),
                "ttft_p99_s": round(percentile(ttfts, 99), 3),
                "e2e_p50_s": round(percentile([o.latency for o in ok], 50), 3),
                "e2e_p99_s": round(percentile([o.latency for o in ok], 99), 3),
            }
        r.rss_growth = rss_growth(r.rss_mb)
        out = self.cfg.output_dir
        (out / "soak.json").write_text(json.dumps(asdict(r), indent=1))
        plot_rss(r.rss_mb, out / "rss.png")
        (out / "soak.md").write_text(markdown(r))


def rss_growth(samples: list[tuple[float, int, float]]) -> float | None:
    """RSS growth of the last server instance after its warm-up (its first third): the median
    of its last tenth of samples over the median of the tenth that ends the warm-up, less 1."""
    last = [mb for _, instance, mb in samples if instance == max(s[1] for s in samples)]
    if len(last) < 10:
        return None
    tenth = max(len(last) // 10, 1)
    warm = len(last) // 3
    base = sorted(last[warm - tenth : warm])[tenth // 2]
    end = sorted(last[-tenth:])[tenth // 2]
    return round(end / base - 1, 4)


def markdown(r: SoakReport) -> str:
    lines = [
        f"soak: {r.duration_s:.0f} s, {r.clients} clients, {r.served} requests served",
        f"errors by code: {json.dumps(r.errors, sort_keys=True)}",
        f"outcomes by kind: {json.dumps(r.outcomes_by_kind, sort_keys=True)}",
        *[f"{p}: {json.dumps(v)}" for p, v in r.latency.items()],
        f"RSS growth after warm-up: {r.rss_growth}",
        f"leaked slots: {r.leaked_slots}, leaked rows: {r.leaked_rows}, "
        f"leaked state slots: {r.leaked_state_slots}",
        f"killed clients' abort times (s): {r.abort_times_s}",
        f"server deaths: {r.server_deaths}; restart exit code {r.restart_exit_code}; "
        f"final exit code {r.final_exit_code}",
        f"invariant checks: {r.invariant_checks}, failures: {len(r.invariant_failures)}",
        f"malformed frames answered: {r.malformed_answered} of {r.malformed_sent}",
        f"targets met: {r.passed()}",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    client = sub.add_parser("client", help="one client process (started by the soak)")
    client.add_argument("--url", required=True)
    client.add_argument("--key", required=True)
    client.add_argument("--seed", type=int, default=0)
    client.add_argument("--until", type=float, required=True)
    parser.add_argument("--model", default="default")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--max-total-tokens", type=int, default=4096)
    parser.add_argument("--kill-every", type=float, default=15.0, help="seconds between SIGKILLs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=Path("bench_results/soak"))
    args = parser.parse_args(argv)
    if args.command == "client":
        run_client(args.url, args.key, args.seed, args.until)
        return
    cfg = SoakConfig(
        args.model,
        args.duration,
        args.clients,
        args.output_dir,
        args.seed,
        args.max_total_tokens,
        args.kill_every,
    )
    report = Soak(cfg).run()
    print(markdown(report), end="")
    sys.exit(0 if report.passed() else 1)


if __name__ == "__main__":
    main()
