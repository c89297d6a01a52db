"""`radixrt bench`: the suite a `BenchConfig` names, run against radixrt, its baselines and its
peers, its results written under `--output-dir`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from radixrt.bench.config import BenchConfig
from radixrt.bench.report import BenchRun, Setup
from radixrt.bench.results import RunResult
from radixrt.bench.suites import suite_for


def run_bench(config: BenchConfig) -> dict[str, list[RunResult]]:
    """Run `config`'s suite; returns its results per workload ({} for the HTTP suites). With
    `--model-shape`, the shape's checkpoint (made first, once) is the model."""
    from radixrt.bench.shapes import prepare
    from radixrt.executor.model_loader import resolve_model_path

    if config.model_shape:
        config = replace(config, model=str(prepare(config.model_shape).folder))

    out_dir = Path(config.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    setup = Setup.collect(config, resolve_model_path(config.model))
    run = BenchRun(config, setup, out_dir)
    try:
        return suite_for(config)(run)
    finally:
        run.servers.close()
