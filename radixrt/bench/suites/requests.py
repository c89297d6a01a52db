"""Request workloads (`--workload shared-prefix`, ..., `few-shot`): each system of the
comparison under each load, then the table, the JSON file, and the plots that workload has (a
rate sweep's throughput and TTFT against rate, long-prompt's ITL CDF)."""

from __future__ import annotations

from dataclasses import replace

from radixrt.bench.datasets import ALL_REQUEST_WORKLOADS
from radixrt.bench.floors import MachineRates
from radixrt.bench.registry import register
from radixrt.bench.report import BenchRun
from radixrt.bench.results import RunResult
from radixrt.bench.systems import RequestJob, run_system


@register(*ALL_REQUEST_WORKLOADS)
def run_request_suite(run: BenchRun) -> dict[str, list[RunResult]]:
    return run_request_workloads(run, [run.config.workload])


def run_request_workloads(run: BenchRun, workloads: list[str]) -> dict[str, list[RunResult]]:
    """Each of `workloads` in turn, with one tokenizer and the machine's rates measured once,
    just before the runs, on the cores they will use."""
    from transformers import AutoTokenizer

    from radixrt.executor.model_loader import resolve_model_path

    model_dir = resolve_model_path(run.config.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    machine = MachineRates.measure()
    run = replace(run, setup=replace(run.setup, machine_rates=machine))
    print(
        f"machine: float32 GEMM {machine.gemm_flops / 1e9:.0f} GFLOP/s, "
        f"read {machine.read_bandwidth / 1e9:.1f} GB/s"
    )
    everything = {}
    for workload in workloads:
        make = ALL_REQUEST_WORKLOADS[workload]
        sessions = make(tokenizer, run.config.shape)
        job = RequestJob(run.config, sessions, tokenizer, model_dir, machine, run.servers)
        systems = run.config.systems_for(workload)
        results = [r for system in systems for r in run_system(system, job)]
        run.report(workload, systems, results)
        _plot(workload, results, run)
        everything[workload] = results
    return everything


def _plot(workload: str, results: list[RunResult], run: BenchRun) -> None:
    from radixrt.bench.plots import plot_cdf

    if run.config.rates:
        _plot_sweep(workload, results, run)
    itls = {r.system: r.short_itls for r in results if r.short_itls}
    if workload == "long-prompt" and itls:
        path = plot_cdf(
            itls,
            run.out_dir / "long-prompt-itl.png",
            "inter-token latency (s)",
            "short requests: ITL CDF",
        )
        print(f"plot: {path}")


def _plot_sweep(workload: str, results: list[RunResult], run: BenchRun) -> None:
    """Throughput and TTFT against rate per system, and the rate where median TTFT crosses the
    SLO."""
    from radixrt.bench.plots import plot_sweep

    slo = run.config.slo
    points: dict[str, list[tuple[float, float, float, float]]] = {}
    for r in results:
        if r.request_rate is not None:
            s = r.summary
            row = (r.request_rate, s.output_throughput, s.ttft.p50, s.ttft.p99)
            points.setdefault(r.system, []).append(row)
    for system, rows in points.items():
        knee = next((rate for rate, _, p50, _ in rows if p50 > slo.ttft_s), None)
        print(
            f"{system}: median TTFT "
            + (
                f"crosses the {slo.ttft_s:g}s SLO at {knee:g} req/s"
                if knee
                else f"stays under {slo.ttft_s:g}s up to {rows[-1][0]:g} req/s"
            )
        )
    path = plot_sweep(
        points, slo.ttft_s, run.out_dir / f"{workload}-sweep.png", f"{workload}: request-rate sweep"
    )
    print(f"plot: {path}")
