"""`--workload all`: every request workload, then every program workload, each as its own
suite would run it, plus a bar plot of radixrt's cache hit rate per workload."""

from __future__ import annotations

from radixrt.bench.programs import PROGRAM_WORKLOADS
from radixrt.bench.registry import register
from radixrt.bench.report import BenchRun
from radixrt.bench.results import RunResult
from radixrt.bench.suites.programs import run_program_workloads
from radixrt.bench.suites.requests import run_request_workloads
from radixrt.bench.workloads import REQUEST_WORKLOADS


@register("all")
def run_every_workload(run: BenchRun) -> dict[str, list[RunResult]]:
    from radixrt.bench.plots import plot_bars

    everything = {
        **run_request_workloads(run, list(REQUEST_WORKLOADS)),
        **run_program_workloads(run, list(PROGRAM_WORKLOADS)),
    }
    hits = {
        workload: results[0].cache_hit_rate
        for workload, results in everything.items()
        if results and results[0].cache_hit_rate is not None
    }
    path = plot_bars(
        hits,
        run.out_dir / "cache-hit-rate.png",
        "cache hit rate",
        "radixrt: cache hit rate per workload",
    )
    print(f"plot: {path}")
    return everything
