"""Run one system (a radixrt variant or a peer) over one request workload under each load.

A radixrt system is launched with the run's `BenchServer` settings and its variant's over them;
a data-parallel variant's fleet shares `--max-total-tokens` among its workers, so every system
has the same KV memory. One server per system serves the whole bench run (every load of a
sweep, every workload of `--workload all`), its cache flushed before each load.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixrt.bench.config import BenchConfig, BenchServer
from radixrt.bench.floors import MachineRates
from radixrt.bench.load import REPLY_TIMEOUT_S, Load, run_load
from radixrt.bench.peers import (
    LLAMA_CPP_MISSING,
    LLAMA_SERVER_MISSING,
    LlamaCppTarget,
    LlamaServerTarget,
    llama_cpp_available,
    llama_cpp_tool,
    run_transformers,
)
from radixrt.bench.results import RunResult, ServerCounters, result_of, stats_delta
from radixrt.bench.variants import LLAMA_PEERS, VARIANTS
from radixrt.bench.workloads import Session

MAX_LLAMA_SLOTS = 64
TRANSFORMERS_BATCH = 64  # transformers' padded batch when --concurrency is unset


class Servers:
    """The radixrt servers of one bench run, each started on first use and kept until `close`:
    a start costs seconds of imports and a model load, so with several workloads one server per
    (system, launcher kind) serves them in turn, its cache flushed before each load. A result's
    peak memory is therefore the server's peak so far in the run."""

    def __init__(self) -> None:
        self._live: dict[tuple[str, type], Any] = {}

    def get(self, server: BenchServer, system: str, kind: type) -> Any:
        """`system`'s running server (`kind`: Runtime or Engine), started now if it is not."""
        key = (system, kind)
        if key not in self._live:
            target = radixrt_target(server, system, kind)
            target.generate("warm up", {"max_new_tokens": 2})
            self._live[key] = target
        return self._live[key]

    def close(self) -> None:
        """Shut every server down (the run is over)."""
        while self._live:
            self._live.popitem()[1].shutdown()


@dataclass(frozen=True)
class RequestJob:
    """One request workload's inputs, the same for every system compared on it."""

    config: BenchConfig
    sessions: list[Session]
    tokenizer: Any  # the model's Hugging Face tokenizer
    model_dir: Path
    machine: MachineRates  # measured once, before the first run
    servers: Servers  # the run's, shared by its workloads

    def render(self, messages: list[dict[str, str]]) -> str:
        """A chat session's history as the model's prompt."""
        text: str = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return text


def radixrt_target(server: BenchServer, system: str, kind: type) -> Any:
    """A launcher (`kind`: Runtime or Engine) of `system`'s settings over the run's."""
    variant = VARIANTS[system]
    pool = server.max_total_tokens and server.max_total_tokens // variant.get("dp_size", 1)
    return kind(
        model=server.model,
        dtype=server.dtype,
        max_total_tokens=pool,
        log_level="warning",
        timeout=REPLY_TIMEOUT_S,
        **{
            "tp_size": server.tp_size,
            "chunked_prefill_size": server.chunked_prefill_size,
            **variant,
        },
    )


def run_system(system: str, job: RequestJob) -> list[RunResult]:
    """`system` under each of the run's loads in turn; [] for a peer that cannot run here (the
    reason printed)."""
    if system == "transformers":
        return _run_transformers(job)
    if system in LLAMA_PEERS:
        return _run_llama_peer(system, job)
    return _run_radixrt(system, job)


def _run_radixrt(system: str, job: RequestJob) -> list[RunResult]:
    from radixrt.client.launcher import Engine, Runtime

    kind = Runtime if job.config.backend == "server" else Engine
    target = job.servers.get(job.config.server, system, kind)
    weights = target.model_info["weights"]
    results = []
    for load in job.config.loads:
        target.flush_cache()
        before = target.stats()
        traces, duration = run_load(
            target, job.sessions, load, job.render, desc=f"{system} ({load.describe()})"
        )
        counters = ServerCounters(stats_delta(before, target.stats()), job.machine, weights)
        result = result_of(system, load, traces, duration, job.config.slo, counters)
        result.rank_peak_rss_mb = rank_peak_rss_mb(target)
        results.append(result)
    return results


def _run_transformers(job: RequestJob) -> list[RunResult]:
    """Padded batches in the bench's own process: single-turn raw prompts only."""
    if any(s.chat or len(s.turns) > 1 for s in job.sessions):
        print("transformers skipped: it runs single-turn raw prompts only")
        return []
    config = job.config
    batch = config.concurrency or TRANSFORMERS_BATCH
    traces, duration = run_transformers(
        job.model_dir, job.sessions, job.tokenizer, config.dtype, batch
    )
    result = result_of("transformers", Load(), traces, duration, config.slo)
    result.load = f"padded batches of {batch}"
    return [result]


def rank_peak_rss_mb(target: Any) -> list[float] | None:
    """Peak resident memory (Linux VmHWM) of the runtime process and its rank processes (or, for
    a fleet, the router's process and its workers), in MB; None where that cannot be read
    (another OS, a remote server)."""
    import psutil

    proc = getattr(target, "_proc", None)
    if proc is None:
        return None
    server = psutil.Process(proc.pid)
    ranks = [server] + [
        p
        for p in server.children(recursive=True)
        if "spawn_main" in (cmd := " ".join(p.cmdline())) or " radixrt serve " in cmd
    ]
    peaks = [peak_rss_mb(p.pid) for p in ranks]
    return None if None in peaks else peaks  # type: ignore[return-value]


def peak_rss_mb(pid: int) -> float | None:
    """A process's peak resident memory (Linux VmHWM) in MB; None where it cannot be read."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return (
        next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM"))
        / 1024
    )


def _run_llama_peer(system: str, job: RequestJob) -> list[RunResult]:
    """llama.cpp through llama-cpp-python, or llama.cpp's llama-server; [] (the reason printed)
    when the model is no GGUF file or the peer is not installed."""
    gguf = _gguf_of(job.config)
    if gguf is None:
        print(f"{system} skipped: the model is not a GGUF file")
        return []
    if system == "llama.cpp":
        if not llama_cpp_available():
            print(LLAMA_CPP_MISSING)
            return []
        return _run_llama_cpp(gguf, job)
    binary = llama_cpp_tool("llama-server")
    if binary is None:
        print(LLAMA_SERVER_MISSING)
        return []
    return _run_llama_server(binary, gguf, job)


def _run_llama_load(system: str, target: Any, load: Load, job: RequestJob) -> RunResult:
    traces, duration = run_load(target, job.sessions, load, job.render, desc=system)
    return result_of(system, load, traces, duration, job.config.slo)


def _run_llama_cpp(gguf: Path, job: RequestJob) -> list[RunResult]:
    """One llama-cpp-python target for every load."""
    target = LlamaCppTarget(gguf, threads=os.cpu_count())
    try:
        return [_run_llama_load("llama.cpp", target, load, job) for load in job.config.loads]
    finally:
        target.close()


def _run_llama_server(binary: Path, gguf: Path, job: RequestJob) -> list[RunResult]:
    """llama-server started for each load: at its own defaults, or, where the bench sizes the
    KV memory (`--max-total-tokens`), with as many slots as that load has requests in flight
    at most."""
    results = []
    for load in job.config.loads:
        slots = None
        if job.config.max_total_tokens is not None:
            slots = min(load.concurrency or len(job.sessions), MAX_LLAMA_SLOTS)
        target = LlamaServerTarget(binary, gguf, slots)
        try:
            result = _run_llama_load("llama-server", target, load, job)
            peak = peak_rss_mb(target.proc.pid)
            result.rank_peak_rss_mb = None if peak is None else [peak]
        finally:
            target.close()
        result.load = f"{result.load}, {slots or 'default'} slots"
        results.append(result)
    return results


def _gguf_of(config: BenchConfig) -> Path | None:
    """The GGUF file of the run's weights: the model's own, or the shape's of the chosen type."""
    from radixrt.bench.shapes import prepare
    from radixrt.executor.model_loader import default_gguf_path

    if config.model_shape:
        return prepare(config.model_shape).ggufs[config.llama_gguf_type]
    if config.model == "default":
        return default_gguf_path()
    return Path(config.model) if config.model.endswith(".gguf") else None
