"""DSL program workloads (`--workload agent`, `few-shot-select`, `tree-of-thought`): each
radixrt system runs the batch of programs over the socket with `run_batch`; programs/s and the
cache hit rate per system (peers run no programs, so they are left out)."""

from __future__ import annotations

import time

from radixrt.bench.metrics import summarize
from radixrt.bench.programs import PROGRAM_WORKLOADS, program_workloads
from radixrt.bench.registry import register
from radixrt.bench.report import BenchRun
from radixrt.bench.results import RunResult
from radixrt.bench.variants import VARIANTS

PROGRAM_COUNTERS = (
    "generated_tokens",
    "prompt_tokens_total",
    "cached_prompt_tokens_total",
    "num_preemptions",
    "evicted_tokens",
)  # the stats a program run reads as their change over it


@register(*PROGRAM_WORKLOADS)
def run_program_suite(run: BenchRun) -> dict[str, list[RunResult]]:
    return run_program_workloads(run, [run.config.workload])


def run_program_workloads(run: BenchRun, workloads: list[str]) -> dict[str, list[RunResult]]:
    """Each of `workloads` in turn, reported like a request workload."""
    everything = {}
    for workload in workloads:
        systems = run.config.systems_for(workload)
        results = [run_programs(run, workload, s) for s in systems if s in VARIANTS]
        run.report(workload, systems, results)
        everything[workload] = results
    return everything


def run_programs(run: BenchRun, workload: str, system: str) -> RunResult:
    """One system's run of the whole batch (its cache flushed first, its counters read before
    and after: the server may have served other workloads); its summary counts programs as
    requests."""
    from radixrt.client.launcher import Runtime

    config = run.config
    program, batch = program_workloads(config.shape.num_requests, config.seed)[workload]
    runtime = run.servers.get(config.server, system, Runtime)
    runtime.flush_cache()
    before = runtime.stats()
    start = time.monotonic()
    for state in program.run_batch(batch, backend=runtime, temperature=0, progress_bar=True):
        state.text()  # raises if the program failed
    duration = time.monotonic() - start
    after = runtime.stats()
    counted = {k: after[k] - before[k] for k in PROGRAM_COUNTERS}
    summary = summarize([], duration, config.slo)
    summary.requests, summary.request_throughput = len(batch), len(batch) / duration
    summary.output_tokens = counted["generated_tokens"]
    summary.output_throughput = counted["generated_tokens"] / duration
    return RunResult(
        system,
        f"run_batch of {len(batch)} programs",
        None,
        None,
        summary,
        counted["cached_prompt_tokens_total"] / max(counted["prompt_tokens_total"], 1),
        counted["num_preemptions"],
        counted["evicted_tokens"],
    )
