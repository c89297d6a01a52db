"""`--workload gpu-check`: on a CUDA machine, the Triton kernels against the torch references,
their timings, and the engine end to end (`radixrt.bench.gpu_check`, which lists the
sections), every section or the `--gpu-sections` named; `make gpu-check` runs it. Its
gpu_check.json and gpu_check.txt under `--output-dir` are rewritten after every section (a
timeout still leaves the finished parts); the last gpu_check.json carries the run's setup."""

from __future__ import annotations

from radixrt.bench.registry import register
from radixrt.bench.report import BenchRun
from radixrt.bench.results import RunResult


@register("gpu-check")
def run_gpu_check(run: BenchRun) -> dict[str, list[RunResult]]:
    from radixrt.bench import gpu_check  # torch and Triton on CUDA: only when the suite runs

    sections = {s.strip() for s in (run.config.gpu_sections or "").split(",") if s.strip()}
    run.write("gpu_check", gpu_check.run(run.out_dir, sections))
    return {}
